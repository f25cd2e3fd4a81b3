"""`tierzero bench` through typer's test runner on a tiny size: JSON keys, the profile that
`tierzero plan --profile` reads, clean-up, and errors; plus the bench plan as data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tierzero.cli.bench import bench
from tierzero.errors import ConfigError
from tierzero.plan import load_profile
from tierzero.storage.base import StorageError
from tierzero.storage.bench import DiskBench
from tierzero.storage.host import HostPool
from tierzero.storage.io import IOLoop

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
    assert [row["chunk_bytes"] for row in nvme["chunk_sweep"]] == [1 << 20, 4 << 20, 8 << 20,
                                                                    32 << 20]
    assert report["fio"] is None
    assert report["adam"]["params_per_s"] > 0
    assert report["compute"]["fp32_tflops"] > 0 and report["compute"]["bf16_tflops"] > 0
    assert set(report["ratios"]) == {"read_vs_raw", "write_vs_raw", "read_vs_fio",
                                     "write_vs_fio"}
    assert report["ratios"]["read_vs_fio"] is None
    assert json.loads(profile.read_text()) == report
    assert load_profile(profile).nvme_read_gbps == nvme["read_gbps"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]  # bench files gone


def test_table_output(tmp_path: Path) -> None:
    result = run("--path", str(tmp_path), *TINY)
    assert result.exit_code == 0, result.output
    assert "store 8 MiB (default)" in result.stdout
    assert "store / raw" in result.stdout


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_comparison(tmp_path: Path) -> None:
    result = run("--path", str(tmp_path), *TINY, "--fio", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["fio"]["read_gbps"] > 0 and report["fio"]["write_gbps"] > 0
    assert "iodepth=" in report["fio"]["write_config"]
    assert report["ratios"]["write_vs_fio"] > 0
    assert list(tmp_path.iterdir()) == []


def test_errors_are_domain_errors(tmp_path: Path) -> None:
    missing = run("--path", str(tmp_path / "missing"), *TINY, "--json")
    assert isinstance(missing.exception, StorageError)
    assert "does not exist" in str(missing.exception)
    tiny = run("--path", str(tmp_path), "--size", "1000", "--json")
    assert isinstance(tiny.exception, ConfigError)
    assert "--size" in str(tiny.exception)


def test_plan_interleaves_and_lays_out_first(tmp_path: Path) -> None:
    with IOLoop(2) as io_loop, HostPool(4 << 20) as pool:
        labels = [step.label for step in DiskBench(str(tmp_path), 64 << 20, io_loop, pool,
                                                   rounds=2, fio=True).steps()]
        small = [step.label for step in DiskBench(str(tmp_path), 4 << 20, io_loop, pool,
                                                  rounds=1, fio=True).steps()]
    assert labels[:3] == ["raw layout", "store layout, 8 MiB chunks",
                          "store layout, 8 MiB chunks"]
    assert labels.index("fio sweep: read bs=8M iodepth=32 numjobs=4") < labels.index(
        "raw write (round 1)")
    round_2 = labels[labels.index("raw write (round 2)"):][:6]
    assert round_2 == ["raw write (round 2)", "store write (round 2)", "fio write (round 2)",
                       "raw read (round 2)", "store read (round 2)", "fio read (round 2)"]
    assert sum("fio sweep" in label for label in labels) == 16
    # 4 MiB split over 4 jobs is smaller than one 8 MiB block: fio refuses those configs.
    assert [label for label in small if "fio sweep: write" in label] == [
        "fio sweep: write bs=1M iodepth=8 numjobs=1", "fio sweep: write bs=1M iodepth=8 numjobs=4",
        "fio sweep: write bs=1M iodepth=32 numjobs=1", "fio sweep: write bs=1M iodepth=32 numjobs=4"]
