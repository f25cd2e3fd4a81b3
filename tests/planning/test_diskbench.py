"""`tierzero bench` through typer's test runner on a tiny size: JSON keys, the profile that
`tierzero plan --profile` reads, clean-up, and errors; plus the bench plan, fio's sweep and
command line as data, and the bytes every path leaves on disk (incompressible, never repeated)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest
import typer
from tierzero.cli.bench import bench
from tierzero.storage.base import StorageError
from tierzero.storage.host import HostPool
from tierzero.storage.io import IOLoop
from tierzero.storage.nvme import chunkfile
from typer.testing import CliRunner

from tierzero.errors import ConfigError
from tierzero.planning.diskbench import DiskBench
from tierzero.planning.fio import STORE_SHAPE_JOBS, fio_command, fio_sweep, fio_wall_span
from tierzero.planning.placement import load_profile

app = typer.Typer()
app.command()(bench)
TINY = ["--size", "2MiB", "--rounds", "1", "--compute-seconds", "0.01"]


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_json_report_has_the_keys_checks_read(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    result = run("--path", str(tmp_path), *TINY, "--json", "--profile-out", str(profile))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    nvme = report["nvme"]
    for key in ("read_gbps", "write_gbps", "raw_read_gbps", "raw_write_gbps"):
        assert nvme[key] > 0, key
    assert nvme["chunk_bytes"] == 8 << 20
    assert [row["chunk_bytes"] for row in nvme["chunk_sweep"]] == [
        1 << 20,
        4 << 20,
        8 << 20,
        32 << 20,
    ]
    assert report["fio"] is None
    assert report["adam"]["params_per_s"] > 0
    assert report["compute"]["fp32_tflops"] > 0 and report["compute"]["bf16_tflops"] > 0
    assert set(report["ratios"]) == {"read_vs_raw", "write_vs_raw", "read_vs_fio", "write_vs_fio"}
    assert report["ratios"]["read_vs_fio"] is None
    assert set(report["per_round"]) == {
        "store_write_gbps",
        "store_read_gbps",
        "raw_write_gbps",
        "raw_read_gbps",
    }
    assert len(report["per_round"]["store_write_gbps"]) == 1
    assert json.loads(profile.read_text()) == report
    assert load_profile(profile).nvme_read_gbps == nvme["read_gbps"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]  # bench files gone


def test_table_output(tmp_path: Path) -> None:
    result = run("--path", str(tmp_path), *TINY)
    assert result.exit_code == 0, result.output
    assert "store 8 MiB (default)" in result.stdout
    assert "store / raw" in result.stdout


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
@pytest.mark.parametrize("direct", [True, False])
def test_fio_comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    if not direct:  # as on a filesystem without O_DIRECT: buffered, writes timed to their fsync
        monkeypatch.setattr(chunkfile, "probe_direct", lambda directory: False)
    result = run(
        "--path",
        str(tmp_path),
        "--size",
        "32MiB",
        "--rounds",
        "1",
        "--compute-seconds",
        "0.01",
        "--fio",
        "--json",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["nvme"]["direct_io"] is direct
    fio = report["fio"]
    for rw in ("read", "write"):  # the wall span agrees with fio's own figure on units
        assert 0.1 < fio[f"{rw}_gbps"] / fio[f"{rw}_gbps_fio_reported"] < 10
    assert "iodepth=" in report["fio"]["write_config"]
    configs = [row["config"] for row in fio["sweep"]]
    assert "psync bs=1M iodepth=1 numjobs=16" in configs  # the store's shape was tried
    assert ("io_uring" in fio["engines_skipped"]) != any("io_uring" in c for c in configs)
    assert all(row["write_gbps"] > 0 and row["read_gbps"] > 0 for row in fio["sweep"])
    assert report["ratios"]["write_vs_fio"] > 0
    assert list(tmp_path.iterdir()) == []


def test_time_limit_skips_later_groups_whole(tmp_path: Path) -> None:
    result = run(
        "--path",
        str(tmp_path),
        "--size",
        "2MiB",
        "--rounds",
        "3",
        "--compute-seconds",
        "0.01",
        "--max-seconds",
        "1e-9",
        "--json",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    nvme = report["nvme"]
    assert (nvme["rounds"], nvme["rounds_planned"]) == (1, 3)
    assert nvme["write_gbps"] > 0 and nvme["read_gbps"] > 0  # round 1 always runs
    assert [row["write_gbps"] is None for row in nvme["chunk_sweep"]] == [True, True, False, True]
    assert report["ratios"]["write_vs_raw"] > 0 and report["adam"]["params_per_s"] > 0
    assert all(len(v) == 1 for v in report["per_round"].values())
    assert list(tmp_path.iterdir()) == []
    table = run("--path", str(tmp_path), *TINY[:2], "--rounds", "2", "--max-seconds", "1e-9")
    assert "--max-seconds reached: 1 of 2 rounds ran" in table.stdout


def test_errors_are_domain_errors(tmp_path: Path) -> None:
    missing = run("--path", str(tmp_path / "missing"), *TINY, "--json")
    assert isinstance(missing.exception, StorageError)
    assert "does not exist" in str(missing.exception)
    tiny = run("--path", str(tmp_path), "--size", "1000", "--json")
    assert isinstance(tiny.exception, ConfigError)
    assert "--size" in str(tiny.exception)


def test_plan_interleaves_and_lays_out_first(tmp_path: Path) -> None:
    with IOLoop(2) as io_loop, HostPool(4 << 20) as pool:
        labels = [
            step.label
            for step in DiskBench(
                str(tmp_path), 64 << 20, io_loop, pool, rounds=2, fio=True
            ).steps()
        ]
        small = [
            step.label
            for step in DiskBench(str(tmp_path), 4 << 20, io_loop, pool, rounds=1, fio=True).steps()
        ]
    assert labels[:6] == [
        "raw layout, slot 0",
        "raw layout, slot 1",
        *["store layout, 8 MiB chunks, slot 0"] * 2,
        *["store layout, 8 MiB chunks, slot 1"] * 2,
    ]
    assert labels[6:8] == ["fio layout, slot 0", "fio layout, slot 1"]
    assert labels.index("fio sweep: read libaio bs=8M iodepth=32 numjobs=4") < labels.index(
        "raw write (round 1)"
    )
    round_1 = labels[labels.index("raw write (round 1)") :][:6]
    assert round_1 == [
        "raw write (round 1)",
        "store write (round 1)",
        "fio write (round 1)",
        "raw read (round 1)",
        "store read (round 1)",
        "fio read (round 1)",
    ]
    round_2 = labels[labels.index("store write (round 2)") :][:6]  # each takes a turn first
    assert round_2 == [
        "store write (round 2)",
        "fio write (round 2)",
        "raw write (round 2)",
        "store read (round 2)",
        "fio read (round 2)",
        "raw read (round 2)",
    ]
    # no io_uring before open() probes for it; 64 MiB over 16 jobs is too small for 8 MiB blocks
    assert sum("fio sweep" in label for label in labels) == 2 * 9
    # 4 MiB split over 4 jobs is smaller than one 8 MiB block: fio refuses those configs.
    assert [label for label in small if "fio sweep: write" in label] == [
        f"fio sweep: write {c}"
        for c in (
            "libaio bs=1M iodepth=8 numjobs=1",
            "libaio bs=1M iodepth=8 numjobs=4",
            "libaio bs=1M iodepth=32 numjobs=1",
            "libaio bs=1M iodepth=32 numjobs=4",
        )
    ]


def test_every_read_is_of_a_slot_written_a_round_earlier(tmp_path: Path) -> None:
    """Run the plan with the measurements replaced by a log of (path, direction, slot)."""
    calls: list[tuple[str, str, int]] = []
    with IOLoop(2) as io_loop, HostPool(4 << 20) as pool:
        bench = DiskBench(str(tmp_path), 64 << 20, io_loop, pool, rounds=3, fio=True)
        bench._raw = lambda rw, slot, record=True: calls.append(("raw", rw, slot))
        bench._store = lambda rw, c, slot, record=True: calls.append((f"store{c}", rw, slot))
        bench._fio = lambda rw, c, slot, record="round": calls.append(("fio", rw, slot))
        bench._fio_best = lambda rw, slot: calls.append(("fio", rw, slot))
        bench._drop_store = lambda c: calls.append((f"store{c}", "drop", -1))
        for step in bench.steps():
            step.run()
    reads = 0
    for i, (path, rw, slot) in enumerate(calls):
        if rw != "read":
            continue
        reads += 1
        writes = [s for p, d, s in calls[:i] if p == path and d == "write"]
        assert slot in writes, (i, path)  # laid out or written before
        assert writes[-1] != slot, (i, path)  # but not by this path's latest write
    assert reads == 3 * 3 + 9 + 3  # rounds x paths, the fio sweep, the other chunk sizes


def test_fio_sweep_covers_the_stores_concurrency() -> None:
    plain, uring = fio_sweep(set()), fio_sweep({"io_uring"})
    for bs in (1 << 20, 8 << 20):
        assert ("psync", bs, 1, STORE_SHAPE_JOBS) in plain
        assert ("io_uring", bs, 1, STORE_SHAPE_JOBS) in uring
        assert ("io_uring", bs, 32, 1) in uring and ("libaio", bs, 32, 4) in uring
    assert not any(engine == "io_uring" for engine, *_ in plain)
    assert set(plain) < set(uring)


def test_fio_command_writes_incompressible_disjoint_regions() -> None:
    cmd = fio_command(
        "write", ("psync", 8 << 20, 1, 16), "/d/fio.0.bin", 1 << 30, True, "/d/logs/job"
    )
    assert {
        "--refill_buffers=1",
        "--randrepeat=0",
        "--ioengine=psync",
        "--numjobs=16",
        "--iodepth=1",
        "--filename=/d/fio.0.bin",
        "--size=67108864",
        "--offset_increment=67108864",
        "--direct=1",
    } <= set(cmd)
    # buffer_compress_percentage=0 turns fio's scrambling off: every block of a job identical
    assert not any("buffer_compress" in arg or "zero_buffers=1" in arg for arg in cmd)
    assert "--end_fsync=1" in fio_command(
        "write", ("libaio", 1 << 20, 8, 1), "f", 8 << 20, False, "l"
    )


def _sectors(path: Path) -> list[bytes]:
    data = path.read_bytes()
    return [data[i : i + 512] for i in range(0, len(data), 512)]


def test_raw_and_store_write_incompressible_never_repeated_sectors(tmp_path: Path) -> None:
    """After layout and round 1, every 512 B sector in every data file (both raw slots, both
    store slots, the store's spare files) differs from every other, and zlib cannot shrink
    them: a virtual disk has nothing to dedupe or compress."""
    with IOLoop(4) as io_loop, HostPool(64 << 20, alignment=4096) as pool:
        with DiskBench(str(tmp_path), 64 << 20, io_loop, pool, rounds=1) as bench:
            for step in bench.steps():
                if step.group == 0:
                    step.run()
            files = [
                Path(d, n)
                for d, _, names in os.walk(bench._work)
                for n in names
                if os.path.getsize(os.path.join(d, n)) >= 1 << 20
            ]
            sectors = [hash(x) for f in files for x in _sectors(f)]
            sample = b"".join(_sectors(files[0])[::512])
    assert sum(f.name.startswith("raw.") for f in files) == 2
    assert len(files) > 2 + 2 * 8  # 8 MiB chunks: two slots, and spare files
    assert len(sectors) > 4 * (64 << 20) // 512
    assert len(set(sectors)) == len(sectors)
    assert len(zlib.compress(sample, 9)) > 0.99 * len(sample)


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_writes_incompressible_never_repeated_sectors(tmp_path: Path) -> None:
    """The command line as run: 4 jobs with one buffer each, 2 MiB apiece, no sector twice."""
    target = tmp_path / "fio.0.bin"
    cmd = fio_command(
        "write",
        ("psync", 1 << 20, 1, 4),
        str(target),
        8 << 20,
        chunkfile.probe_direct(str(tmp_path)),
        str(tmp_path / "job"),
    )
    subprocess.run(cmd, check=True, capture_output=True)
    sectors = _sectors(target)
    assert len(sectors) == (8 << 20) // 512 and len(set(sectors)) == len(sectors)
    sample = target.read_bytes()[: 1 << 20]
    assert len(zlib.compress(sample, 9)) > 0.99 * len(sample)


def test_fio_is_timed_over_its_wall_span(tmp_path: Path) -> None:
    """Two staggered jobs of 1 GB each: fio would report 2 GB over the longer job's 1 s
    (2 GB/s); the bytes actually moved in 1.5 s of wall time (1.33 GB/s)."""
    t0 = 1_700_000_000_000
    (tmp_path / "job_lat.1.log").write_text(
        f"{t0 + 500}, 500000000, 1, 500000000, 0\n{t0 + 1000}, 500000000, 1, 500000000, 0\n"
    )
    (tmp_path / "job_lat.2.log").write_text(f"{t0 + 1500}, 1000000000, 1, 1000000000, 0\n")
    (tmp_path / "job_clat.1.log").write_text(f"{t0 + 9000}, 1, 1, 999, 0\n")  # ignored
    seconds, nbytes = fio_wall_span(str(tmp_path))
    assert (seconds, nbytes) == (pytest.approx(1.5), 2_000_000_000)
    for log in tmp_path.iterdir():
        log.unlink()
    with pytest.raises(StorageError, match="no latency log"):
        fio_wall_span(str(tmp_path))
