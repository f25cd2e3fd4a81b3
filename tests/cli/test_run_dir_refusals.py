"""Run directories that cannot be mistaken, through the CLI: a FIFO where a file belongs is named
(never waited on), a run directory that is not a directory says what it is, a read-only one is
refused in one sentence by train, resume and report (inspect and export still read it), and
export and inspect name the newer checkpoints they pass over."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierzero.cli.app import app
from typer.testing import CliRunner

from tests.support.cli import one_line_error, train
from tierzero.checkpoint.catalog import step_dir

runner = CliRunner()
HANG_GUARD_S = 300  # a guard against a hang, not a timing threshold


def test_a_fifo_for_metrics_is_named_not_waited_on(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert train("--steps", "1", "--run-dir", str(run_dir)).exit_code == 0
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink()
    os.mkfifo(metrics)
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierzero.cli",
            "train",
            "--resume",
            "--steps",
            "2",
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert resumed.returncode == 2, resumed.stderr
    lines = resumed.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{metrics} is a FIFO, not a regular file" in lines[0], (
        resumed.stderr
    )
    report = runner.invoke(app, ["report", str(run_dir)])
    assert "is a FIFO, not a regular file" in one_line_error(report)


@pytest.mark.parametrize("kind", ["a FIFO", "a regular file"])
def test_a_run_dir_that_is_not_a_directory_says_what_it_is(tmp_path, kind: str) -> None:
    path = tmp_path / "run"
    os.mkfifo(path) if kind == "a FIFO" else path.write_text("")
    expected = f"is {kind}, not a directory"
    assert expected in one_line_error(train("--steps", "1", "--run-dir", str(path)))
    assert expected in one_line_error(train("--resume", "--run-dir", str(path)))
    for command in (
        ["export", str(path), "--out", str(tmp_path / "out")],
        ["inspect", str(path)],
        ["report", str(path)],
    ):
        assert expected in one_line_error(runner.invoke(app, command)), command


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """`path` made read-only: by permissions, or for root (whom permissions do not stop) by a
    read-only bind mount of it onto itself."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            yield
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    mount = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip("running as root and cannot bind-mount a directory read-only here")
    try:
        subprocess.run(
            ["mount", "-o", "remount,ro,bind", str(path)], check=True, capture_output=True
        )
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_read_only_run_dir_is_refused_by_train_and_report_but_read_by_inspect_and_export(
    tmp_path,
) -> None:
    run_dir = tmp_path / "run"
    assert train("--steps", "1", "--run-dir", str(run_dir)).exit_code == 0
    with read_only(run_dir):
        line = one_line_error(train("--resume", "--steps", "2", "--run-dir", str(run_dir)))
        assert f"run directory '{run_dir}' is read-only" in line
        line = one_line_error(runner.invoke(app, ["report", str(run_dir)]))
        assert "read-only" in line and "--out" in line
        inspected = runner.invoke(app, ["inspect", str(run_dir), "--json"])
        assert (
            inspected.exit_code == 0 and json.loads(inspected.stdout)["checkpoints"][0]["step"] == 1
        )
        exported = runner.invoke(app, ["export", str(run_dir), "--out", str(tmp_path / "out")])
        assert exported.exit_code == 0, exported.output
        assert (
            runner.invoke(app, ["report", str(run_dir), "--out", str(tmp_path / "r.png")]).exit_code
            == 0
        )
    # writable again
    assert train("--steps", "1", "--run-dir", str(run_dir), "--overwrite").exit_code == 0


def test_export_and_inspect_name_the_newer_checkpoint_they_skipped(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert (
        train("--steps", "2", "--checkpoint-every", "1", "--run-dir", str(run_dir)).exit_code == 0
    )
    (step_dir(run_dir, 2) / "manifest.json").write_text("{damaged")
    exported = runner.invoke(app, ["export", str(run_dir), "--out", str(tmp_path / "out")])
    assert exported.exit_code == 0, exported.output
    text = " ".join(exported.output.split())
    assert "skipped checkpoint step-00000002" in text and "exported step 1" in text
    inspected = runner.invoke(app, ["inspect", str(run_dir)])
    assert "skipped newer checkpoint: step 2 is damaged" in " ".join(inspected.output.split())


def test_an_export_into_a_directory_removes_temp_files_a_killed_export_left(tmp_path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    assert train("--steps", "1", "--run-dir", str(run_dir)).exit_code == 0
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names a process that is gone, like a killed export's
    out.mkdir()
    stale = out / f".model.safetensors.{dead.pid}.tmp"
    stale.write_bytes(b"half a file")
    assert runner.invoke(app, ["export", str(run_dir), "--out", str(out)]).exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_a_store_path_above_another_runs_store_is_refused_naming_both(tmp_path) -> None:
    inner = tmp_path / "p" / "a"
    inner.mkdir(parents=True)
    assert (
        train("--steps", "1", "--nvme-path", str(inner), "--run-dir", str(tmp_path / "a")).exit_code
        == 0
    )
    before = sorted(str(p) for p in inner.rglob("*"))
    refused = train(
        "--steps", "1", "--nvme-path", str(tmp_path / "p"), "--run-dir", str(tmp_path / "b")
    )
    assert refused.exit_code == 2, refused.output
    # the store opens once training starts
    line = " ".join(refused.output.split("error:")[1].split())
    assert f"{tmp_path / 'p'} holds the store directory {inner}" in line
    assert sorted(str(p) for p in inner.rglob("*")) == before
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["a"]
