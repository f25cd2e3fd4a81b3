"""Inspect: a run directory's checkpoints, NVMe arrays per state kind and config, read-only.

The NVMe store is laid out by hand in both layouts the store has used (one array per key, and
one group per key naming its current generation), with odd files among them, so the counts
can be compared with what was written and nothing odd can make inspect crash.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from tierzero.cli.app import app
from tierzero.storage.nvme.arrays import write_array
from typer.testing import CliRunner

from tests.support.checkpoints import flip_byte, write_checkpoint
from tests.support.engine import SMALL
from tierzero import models
from tierzero.checkpoint.inspect import inspect_run, store_info
from tierzero.configfile import load_run_config, to_toml
from tierzero.errors import RunDirError
from tierzero.layout.partition import partition
from tierzero.run.directory import RunDir

runner = CliRunner()


def _generation_array(store: Path, key: str, gen: str, values: torch.Tensor) -> None:
    """The generation layout: `<key>/zarr.json` is a group naming the current generation."""
    group = store / key
    write_array(str(group / gen), values, 4096)
    (group / "zarr.json").write_text(
        json.dumps(
            {"attributes": {"tierzero": {"current": gen}}, "zarr_format": 3, "node_type": "group"}
        )
    )


def _make_store(store: Path) -> dict[str, tuple[int, int]]:
    """A store with arrays of both layouts and odd files; returns (arrays, bytes) per kind."""
    write_array(str(store / "master" / "u0000" / "r0"), torch.zeros(2048), 4096)  # flat layout
    write_array(str(store / "master" / "u0001" / "r0"), torch.zeros(4096), 4096)
    write_array(
        str(store / "param" / "u0000" / "r0"), torch.zeros(2048, dtype=torch.bfloat16), 4096
    )
    _generation_array(store, "exp_avg/u0000/r0", "g000003", torch.zeros(1024))
    # older
    write_array(str(store / "exp_avg" / "u0000" / "r0" / "g000002"), torch.zeros(1024), 4096)
    _generation_array(store, "exp_avg_sq/u0000/r0", "g000001", torch.zeros(1024))
    (store / "zarr.json").write_text(
        json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}})
    )
    (store / ".tierzero-spare").mkdir()
    (store / ".tierzero-spare" / "zarr.json").write_text("not json")  # hidden: never read
    (store / ".tierzero.lock").write_text("")
    (store / "stray.bin").write_bytes(b"\0" * 10)
    (store / "grad" / "u0000" / "r0").mkdir(parents=True)
    (store / "grad" / "u0000" / "r0" / "zarr.json").write_text("{truncated")
    (store / "grad" / "u0001").mkdir(parents=True)
    (store / "grad" / "u0001" / "zarr.json").write_text(
        json.dumps({"node_type": "group", "attributes": {"tierzero": {"current": "g000009"}}})
    )  # gone
    (store / "grad" / "u0002").mkdir(parents=True)
    (store / "grad" / "u0002" / "zarr.json").write_text(
        json.dumps({"node_type": "array", "shape": "x"})
    )
    (store / "grad" / "u0003").mkdir(parents=True)
    (store / "grad" / "u0003" / "zarr.json").write_text("[1, 2]")
    return {
        "master": (2, 6144 * 4),
        "param": (1, 2048 * 2),
        "exp_avg": (1, 4096),
        "exp_avg_sq": (1, 4096),
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run with checkpoints 2 and 5, a half-made 9, and two NVMe paths. Shared: tests that
    change anything work on a copy (`copy_run`)."""
    tmp_path = tmp_path_factory.mktemp("inspect")
    run_dir = tmp_path / "run"
    model = models.build(SMALL, seed=0)
    write_checkpoint(run_dir, model, step=2, world_size=2, chunk_bytes=1 << 20)
    write_checkpoint(run_dir, model, step=5, world_size=2, chunk_bytes=1 << 20)
    (run_dir / "checkpoints" / "step-00000009" / "state").mkdir(parents=True)  # being written
    config = load_run_config(
        overrides={
            "model": "tiny",
            "offload": "nvme",
            "steps": 9,
            "nvme_path": [str(tmp_path / "nvme-a"), str(tmp_path / "nvme-b")],
        }
    )
    (run_dir / "config.toml").write_text(to_toml(config))
    _make_store(tmp_path / "nvme-a")
    (tmp_path / "nvme-b").mkdir()
    return run_dir


def copy_run(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for d, dirs, names in os.walk(root):
        for n in dirs + names:
            st = os.lstat(os.path.join(d, n))
            out[os.path.relpath(os.path.join(d, n), root)] = (st.st_size, st.st_mtime_ns)
    return out


def test_store_counts_current_arrays_per_kind_and_skips_odd_files(tmp_path):
    expected = _make_store(tmp_path / "nvme")
    info = store_info(tmp_path / "nvme")
    assert {k: (t.arrays, t.nbytes) for k, t in info.kinds.items()} == expected
    skipped = "\n".join(info.skipped)
    # truncated JSON, missing generation, bad shape, non-object
    assert len(info.skipped) == 4, skipped
    assert (
        "u0000/r0/zarr.json: JSONDecodeError" in skipped and "g000009 has no zarr.json" in skipped
    )
    assert ".tierzero-spare" not in skipped and "stray.bin" not in skipped


def test_inspect_lists_checkpoints_stores_and_config(run):
    tmp_path = run.parent
    info = inspect_run(run)
    assert [(c.step, c.status) for c in info.checkpoints] == [
        (2, "complete"),
        (5, "complete"),
        (9, "incomplete"),
    ]
    assert "manifest.json is missing" in info.checkpoints[2].reason
    five = info.checkpoints[1]
    units = partition(models.build(SMALL, device="meta"), 2)
    padded = sum(u.padded_numel for u in units)
    assert five.nbytes == padded * (2 + 4 + 4 + 4)  # bf16 param; fp32 master and moments
    assert five.bytes_copied == 0 and five.arrays == 4 * len(units) * 2 and five.time > 0
    assert info.placement == {
        k: "nvme" for k in ("param", "grad", "master", "exp_avg", "exp_avg_sq")
    }
    assert [s.path for s in info.stores] == [str(tmp_path / "nvme-a"), str(tmp_path / "nvme-b")]
    assert info.stores[0].arrays == 5 and info.stores[1].arrays == 0 and info.stores[1].exists
    assert (
        info.config["steps"] == 9 and info.config["offload"] == "nvme" and info.config_error is None
    )


def test_verify_names_the_damaged_chunk(run, tmp_path):
    run = copy_run(run, tmp_path)
    bad = flip_byte(run / "checkpoints" / "step-00000002", "exp_avg_sq/u0001/r1")
    info = inspect_run(run, verify=True)
    assert [(c.step, c.status) for c in info.checkpoints] == [
        (2, "damaged"),
        (5, "ok"),
        (9, "incomplete"),
    ]
    assert bad in info.checkpoints[0].reason and "crc32c" in info.checkpoints[0].reason


def test_inspect_writes_nothing_and_takes_no_lock(run, tmp_path):
    run = copy_run(run, tmp_path)
    with RunDir(run):  # a live trainer holds the lock
        before = _snapshot(tmp_path)
        result = runner.invoke(app, ["inspect", str(run), "--verify", "--json"])
        assert result.exit_code == 0, result.output
        assert _snapshot(tmp_path) == before


def test_odd_run_directories_never_crash(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001" / "manifest.json").write_text("{")
    (run / "checkpoints" / "notastep").mkdir()
    (run / "config.toml").write_text("steps = = 3")
    (run / "nvme").mkdir()
    info = inspect_run(run, verify=True)
    assert [(c.step, c.status) for c in info.checkpoints] == [(1, "damaged")]
    assert "not a readable checkpoint manifest" in info.checkpoints[0].reason
    assert info.config is None and "not valid TOML" in info.config_error
    # the train default, config unreadable
    assert [s.path for s in info.stores] == [str(run / "nvme")]
    assert set(info.placement.values()) == {"unknown"}
    (run / "config.toml").unlink()
    assert "is missing" in inspect_run(run).config_error
    result = runner.invoke(app, ["inspect", str(run)])
    assert result.exit_code == 0, result.output


def test_cli_json_is_one_object(run):
    result = runner.invoke(app, ["inspect", str(run), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [c["step"] for c in doc["checkpoints"]] == [2, 5, 9]
    assert doc["stores"][0]["arrays"] == 5 and doc["stores"][0]["kinds"]["master"] == {
        "arrays": 2,
        "nbytes": 6144 * 4,
    }
    assert doc["config"]["model"] == "tiny"


def test_cli_human_tables(run):
    result = runner.invoke(app, ["inspect", str(run), "--verify"])
    assert result.exit_code == 0, result.output
    for text in (
        "checkpoints of",
        "incomplete",
        "ok",
        "exp_avg_sq",
        "config.toml",
        "skipped",
        "nvme-b",
    ):
        assert text in result.stdout, text


def test_missing_run_dir_is_one_line_exit_2(tmp_path):
    with pytest.raises(RunDirError, match="does not exist"):
        inspect_run(tmp_path / "nope")
    result = runner.invoke(app, ["inspect", str(tmp_path / "nope")])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "does not exist" in lines[0]


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def test_fifos_and_symlinks_are_reported_never_read(run, tmp_path):
    """A FIFO would block a plain open() forever; inspect refuses it (the alarm only turns a
    hang into a failure)."""
    run = copy_run(run, tmp_path)
    _fifo(run / "config.toml")
    steps = sorted((run / "checkpoints").iterdir())
    _fifo(steps[0] / "manifest.json")
    (steps[1] / "manifest.json").rename(tmp_path / "elsewhere.json")
    (steps[1] / "manifest.json").symlink_to(tmp_path / "elsewhere.json")
    info = _inspect_within_a_minute(run, "inspect")
    assert info.config is None and "not a regular file" in info.config_error
    first, second = info.checkpoints[:2]  # steps 2 and 5 (9 is half-made)
    assert first.status == "damaged" and "not a regular file" in first.reason
    assert second.status == "damaged" and "symbolic link" in second.reason


def _inspect_within_a_minute(run, what: str):
    """`inspect_run(run, verify=True)`, failing the test instead of hanging if it blocks."""
    import signal

    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"{what} blocked on a FIFO"))
    signal.alarm(60)
    try:
        return inspect_run(run, verify=True)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_verify_refuses_a_fifo_chunk(run, tmp_path):
    from tierzero.storage.nvme.arrays import chunk_path

    run = copy_run(run, tmp_path)
    step = sorted((run / "checkpoints").iterdir())[0]
    chunk = Path(chunk_path(str(step / "state" / "master" / "u0000" / "r0"), 0))
    _fifo(chunk)
    info = _inspect_within_a_minute(run, "verify")
    assert (
        info.checkpoints[0].status == "damaged"
        and "not a regular file" in info.checkpoints[0].reason
    )
