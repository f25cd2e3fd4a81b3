"""Drive wear, measured: `tierzero train`'s summary says what the run wrote to NVMe (the
engine's write counters, per step and in all, and the process's own storage writes beyond
them), what share of a --drive-tbw rating that is, a note above 1% of it, and refuses a
rating that is not a positive number before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tierzero.cli.app import app
from typer.testing import CliRunner

from tierzero.config import Offload, Placement, StateKind
from tierzero.layout.partition import partition
from tierzero.models import build
from tierzero.planning.placement import Link, estimate
from tierzero.planning.wear import TB, step_nvme_written
from tierzero.planning.workload import Workload
from tierzero.run.directory import read_metrics

runner = CliRunner()
RUN = [
    "--steps",
    "3",
    "--batch-size",
    "2",
    "--seq-len",
    "32",
    "--dtype",
    "fp32",
    "--offload",
    "nvme",
    "--checkpoint-every",
    "2",
]
DRIVE_TBW = 1e-6  # a 1 MB rating: the run writes far more than 1% of it


def projected_step_bytes() -> int:
    """What `tierzero plan` projects a step of this run to write: tiny, fp32, every state on
    NVMe, one micro-batch with overlap_step (the engine's default here)."""
    work = Workload.from_units(partition(build("tiny", device="meta")), 4, device="cpu")
    written = estimate(Placement.for_offload(Offload.NVME), work).moved_bytes[Link.HOST_TO_NVME]
    return step_nvme_written(
        written, work.state_nbytes(StateKind.GRAD), 1, vertical=False, overlapped=True
    )


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    run_dir = tmp_path_factory.mktemp("wear") / "run"
    result = runner.invoke(
        app, ["train", *RUN, "--run-dir", str(run_dir), "--drive-tbw", str(DRIVE_TBW), "--json"]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{") :]), run_dir


def test_the_summary_counts_the_steps_nvme_writes(summary: tuple[dict, Path]) -> None:
    report, run_dir = summary
    wear = report["drive_wear"]
    logged = sum(r["bytes_host->nvme"] for r in read_metrics(run_dir) if "loss" in r)
    assert wear["step_bytes"] == logged > 0 and wear["steps"] == 3
    assert wear["per_step_bytes"] == round(logged / 3)
    assert wear["measured_by"][0] == "engine NVMe write counters (bytes_host->nvme)"
    assert wear["checkpoints"] == 2  # step 2 and the end
    # fp32 master, moments and param written back each step (16 B/param), as plan projects
    assert wear["per_step_bytes"] == pytest.approx(projected_step_bytes(), rel=0.01)


def test_the_process_writes_beyond_the_steps_are_counted(summary: tuple[dict, Path]) -> None:
    """With /proc/self/io (Linux): the process's storage writes beyond the steps' count (its two
    checkpoints' shards are hard links, the metrics and manifests small) go to the run's total."""
    wear = summary[0]["drive_wear"]
    if len(wear["measured_by"]) == 1:
        pytest.skip("the kernel does not count this process's storage writes here")
    assert wear["measured_by"][1] == "/proc/self/io write_bytes"
    assert wear["run_bytes"] == wear["step_bytes"] + wear["checkpoint_bytes"]


def test_the_rating_share_and_its_note(summary: tuple[dict, Path], tmp_path: Path) -> None:
    wear = summary[0]["drive_wear"]
    assert wear["drive_tbw"] == DRIVE_TBW and wear["note_fraction"] == 0.01
    assert wear["rating_fraction"] == pytest.approx(wear["run_bytes"] / (DRIVE_TBW * TB))
    assert wear["per_1000_steps_fraction"] == pytest.approx(wear["rating_fraction"] * 1000 / 3)
    assert wear["over_note"] is True
    config = tmp_path / "drive.toml"  # the rating from a --config file, as `drive_tbw`
    config.write_text(f"drive_tbw = {DRIVE_TBW}\n")
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["train", "--config", str(config), *RUN, "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert f"drive_tbw = {DRIVE_TBW}" in (run_dir / "config.toml").read_text()  # a resume keeps it
    assert (
        "NVMe writes: " in result.output
        and "per step (the engine's write counters)" in result.output
    )
    assert f"of a {DRIVE_TBW:g} TBW drive's rating" in result.output
    assert "note: this run writes" in result.output and "(over 1% for one run)" in result.output


@pytest.mark.parametrize("value", ["0", "-600"])
def test_a_rating_that_is_not_positive_is_refused_before_the_run(
    tmp_path: Path, value: str
) -> None:
    result = runner.invoke(
        app, ["train", *RUN, "--run-dir", str(tmp_path / "run"), "--drive-tbw", value]
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output
    assert "--drive-tbw must be the drive's rated endurance in terabytes written" in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_rating_in_a_config_file_is_checked_too(tmp_path: Path) -> None:
    config = tmp_path / "drive.toml"
    config.write_text("drive_tbw = 0\n")
    result = runner.invoke(
        app, ["train", "--config", str(config), *RUN, "--run-dir", str(tmp_path / "run")]
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "drive_tbw must be a finite number > 0, got 0" in lines[0]
