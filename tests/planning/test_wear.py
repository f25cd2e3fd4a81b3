"""Drive wear, projected: the NVMe bytes `tierzero plan` says a step and a run write, counted
by hand from the placement, against a drive's rated terabytes written; the note above 1% of
the rating and the refusal of a rating that is not a positive number."""

from __future__ import annotations

import json

import pytest
from tierzero.cli.app import app
from typer.testing import CliRunner

from tierzero.config import DType, Placement, StateKind, Tier
from tierzero.errors import ConfigError
from tierzero.models.presets import PRESETS
from tierzero.planning.ledger import units_from_args
from tierzero.planning.planreport import make_plan
from tierzero.planning.statebytes import StateBytes
from tierzero.planning.wear import (
    TB,
    WEAR_NOTE_FRACTION,
    DriveWear,
    checkpoint_nbytes,
    checkpoints_taken,
    step_nvme_written,
)
from tierzero.planning.workload import Workload

MACHINE_24GB = {
    "gpu_mem": "24GB",
    "host_mem": "32GB",
    "nvme_free": "4TB",
    "batch_size": 1,
    "seq_len": 512,
}
SEVEN_B = PRESETS["7b"].param_count()


def test_a_7b_on_a_24gb_gpu_writes_its_optimizer_state_every_step() -> None:
    """32 GB of RAM holds the fp32 grads, not the optimizer: master and both moments live on
    NVMe and are written back every step (12 B/param); the bf16 params live on the GPU, so each
    checkpoint writes them (2 B/param) and links the NVMe state."""
    report = make_plan("7b", steps=1000, checkpoint_every=100, drive_tbw=600, **MACHINE_24GB)
    assert report.placement == Placement(Tier.GPU, Tier.HOST, Tier.NVME, Tier.NVME, Tier.NVME)
    assert report.workload.state_shard_numel == SEVEN_B
    assert report.step_nvme_write_bytes() == 3 * 4 * SEVEN_B
    wear = report.wear
    assert (wear.steps, wear.checkpoints) == (1000, 10)
    assert wear.step_bytes == 1000 * 12 * SEVEN_B
    assert wear.checkpoint_bytes == 10 * 2 * SEVEN_B
    assert wear.rating_fraction == pytest.approx((1000 * 12 + 10 * 2) * SEVEN_B / (600 * TB))
    assert wear.rating_fraction == pytest.approx(0.135, abs=5e-4)  # 81 TB of a 600 TB rating
    assert wear.per_1000_steps_fraction == pytest.approx(wear.rating_fraction)
    assert wear.over_note
    assert report.as_dict()["drive_wear"] == wear.as_dict()


def test_compact_state_on_the_host_writes_nothing_per_step() -> None:
    """int8 moments and a bf16 master fit 64 GB of RAM: nothing is homed on NVMe, so the steps
    write nothing, and a checkpoint writes the whole state it saves (6 B/param: one bf16
    weight, two int8 moments with their scales)."""
    report = make_plan(
        "7b",
        gpu_mem="24GB",
        host_mem="64GB",
        nvme_free="80GB",
        dtype="bf16",
        batch_size=8,
        seq_len=128,
        optimizer_state="int8",
        master="bf16",
    )
    assert all(report.placement.home(k) is not Tier.NVME for k in StateKind)
    assert report.step_nvme_write_bytes() == 0
    wear = report.wear
    assert (wear.steps, wear.checkpoints, wear.step_bytes) == (
        80,
        1,
        0,
    )  # train's default run: one checkpoint
    assert wear.checkpoint_bytes == checkpoint_nbytes(report.workload, report.placement)
    assert 6 * SEVEN_B <= wear.checkpoint_bytes <= 6.1 * SEVEN_B
    assert wear.rating_fraction is None and not wear.over_note


def test_step_writes_by_schedule_and_overlap() -> None:
    """A pass's writes by the placement's traffic hold one store of the grads; overlap_step
    skips the last micro-batch's, horizontal accumulation stores every other one again,
    vertical stores none between micro-batches but writes the spilled activations."""
    one, grad = 1000, 100
    assert step_nvme_written(one, grad, 1, vertical=False) == 1000
    assert step_nvme_written(one, grad, 1, vertical=False, overlapped=True) == 900
    assert step_nvme_written(one, grad, 4, vertical=False) == 1000 + 3 * 100
    assert step_nvme_written(one, grad, 4, vertical=False, overlapped=True) == 900 + 3 * 100
    assert step_nvme_written(one, grad, 4, vertical=True, spilled_bytes=50) == 1050
    assert step_nvme_written(one, grad, 4, vertical=True, spilled_bytes=50, overlapped=True) == 950
    assert (
        step_nvme_written(one, 0, 4, vertical=False, overlapped=True) == 1000
    )  # grads not on NVMe


def test_checkpoints_every_n_steps_and_at_the_end() -> None:
    assert checkpoints_taken(80, None) == 1
    assert checkpoints_taken(1000, 100) == 10
    assert checkpoints_taken(1000, 300) == 4  # 300, 600, 900 and the end
    assert checkpoints_taken(5, 10) == 1


def test_a_checkpoint_writes_the_saved_states_homed_in_memory() -> None:
    """Params, master and moments (not grads), every rank's; NVMe-homed ones are links."""
    work = Workload.from_sizes(units_from_args(PRESETS["tiny"]), compute_itemsize=2, world_size=2)
    n, p = work.state_shard_numel, work.param_numel
    host = Placement(Tier.GPU, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)
    assert checkpoint_nbytes(work, host) == 2 * (2 * p + 3 * 4 * n)
    assert (
        checkpoint_nbytes(work, Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME))
        == 0
    )
    one = Workload.from_sizes(
        units_from_args(PRESETS["tiny"]),
        compute_itemsize=2,
        trainable=[0, *[1024] * 4, 0],
        formats=StateBytes.for_compute("bf16", "bf16", DType.BF16),
    )  # the param is the master
    on_host = Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)
    frozen, trained = (one.param_numel - 4 * 1024, 4 * 1024)  # the master holds the trained params
    assert one.state_shard_numel == trained
    assert checkpoint_nbytes(one, on_host) == frozen * 2 + 3 * 2 * trained


def test_a_rating_share_and_its_note() -> None:
    wear = DriveWear(
        steps=200, step_bytes=4 * TB, checkpoint_bytes=2 * TB, checkpoints=2, drive_tbw=300
    )
    assert wear.run_bytes == 6 * TB and wear.per_step_bytes == 4 * TB / 200
    assert wear.rating_fraction == pytest.approx(
        0.02
    ) and wear.per_1000_steps_fraction == pytest.approx(0.1)
    assert wear.over_note and WEAR_NOTE_FRACTION == 0.01
    assert not DriveWear(200, 2 * TB, 0, 1, 300).over_note  # 0.67%
    measured = DriveWear.measured(
        10, nvme_bytes=500, process_bytes=800, checkpoints=1, drive_tbw=None
    )
    assert (measured.step_bytes, measured.checkpoint_bytes) == (
        500,
        300,
    )  # the process's writes beyond the steps'
    assert DriveWear.measured(10, 500, 200, 1, None).run_bytes == 500  # the larger count
    assert DriveWear.measured(10, 500, None, 1, None).run_bytes == 500


def plan(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "100"})
    return result.exit_code, result.output


MACHINE_FLAGS = [
    "--model",
    "7b",
    "--gpu-mem",
    "24GB",
    "--host-mem",
    "32GB",
    "--nvme-free",
    "4TB",
    "--batch-size",
    "1",
    "--seq-len",
    "512",
]


def test_plan_prints_the_writes_and_notes_a_run_over_one_percent() -> None:
    code, text = plan(
        *MACHINE_FLAGS, "--steps", "1000", "--checkpoint-every", "100", "--drive-tbw", "600"
    )
    assert code == 0, text
    assert (
        "NVMe writes: 80.86 GB per step, 81.00 TB over 1000 steps (with 10 checkpoint(s): "
        "134.77 GB)" in text
    )
    assert "Drive wear: 13.5% of a 600 TBW drive's rating, 13.5% per 1000 steps" in text
    assert (
        "note: this run writes 13.5% of the drive's rated endurance (over 1% for one run)" in text
    )
    code, text = plan(*MACHINE_FLAGS, "--steps", "50", "--drive-tbw", "600")  # 4 TB: 0.67%
    assert (
        code == 0
        and "Drive wear: 0.676% of a 600 TBW" in text
        and "note: this run writes" not in text
    )
    code, text = plan(*MACHINE_FLAGS)
    assert "Drive wear" not in text and "NVMe writes: 80.86 GB per step" in text
    code, out = plan(*MACHINE_FLAGS, "--steps", "1000", "--drive-tbw", "600", "--json")
    wear = json.loads(out)["drive_wear"]
    assert (
        wear["per_step_bytes"] == 12 * SEVEN_B
        and wear["over_note"] is True
        and wear["drive_tbw"] == 600
    )


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_plan_refuses_a_rating_that_is_not_positive(value: str) -> None:
    code, text = plan("--model", "tiny", "--nvme-free", "1TB", "--drive-tbw", value)
    assert code == 2
    assert "--drive-tbw must be the drive's rated endurance in terabytes written" in text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1


def test_the_python_plan_refuses_it_too() -> None:
    with pytest.raises(ConfigError, match="--drive-tbw must be"):
        make_plan("tiny", nvme_free="1TB", drive_tbw=0)
    with pytest.raises(ConfigError, match="--steps must be an integer >= 1"):
        make_plan("tiny", nvme_free="1TB", steps=0)
