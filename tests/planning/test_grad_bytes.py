"""The planned grad dtype: chosen once (`statebytes.grad_dtype`), counted by the memory model
and the NVMe bytes per step, and named by `tierzero plan`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.support.engine import SMALL
from tierzero import Config, Placement, Tier, models
from tierzero.config import DType, Schedule
from tierzero.engine import Engine
from tierzero.planning.homes import describe_homes, home_bytes
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.planreport import make_plan
from tierzero.planning.statebytes import StateBytes, grad_dtype
from tierzero.planning.workload import Workload

NVME = Placement(*[Tier.NVME] * 5)
HOST = Placement(Tier.GPU, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)
MACHINE = {"gpu_mem": "4GB", "host_mem": "4GB", "nvme_free": "1TB"}
SHARD = 1 << 20


@pytest.mark.parametrize(
    "compute, accumulate, schedule, expected",
    [
        (DType.BF16, 1, Schedule.AUTO, DType.BF16),
        (DType.BF16, 1, Schedule.HORIZONTAL, DType.BF16),
        (DType.BF16, 4, Schedule.VERTICAL, DType.BF16),
        (DType.BF16, 4, Schedule.HORIZONTAL, DType.FP32),
        (DType.BF16, 4, Schedule.AUTO, DType.FP32),
        (DType.FP32, 1, Schedule.AUTO, DType.FP32),
        (DType.FP16, 1, Schedule.VERTICAL, DType.FP32),
    ],
)
def test_grads_are_bf16_only_where_nothing_is_added_to_a_stored_one(
    compute, accumulate, schedule, expected
) -> None:
    assert grad_dtype(compute, accumulate, schedule) is expected


@pytest.mark.parametrize("accumulate, schedule", [(1, "auto"), (2, "horizontal"), (2, "vertical")])
def test_the_plan_and_the_engine_choose_the_same_grad_dtype(
    tmp_path, accumulate: int, schedule: str
) -> None:
    engine = Engine(
        models.build(SMALL, device="meta"),
        Config(
            offload="host",
            dtype="bf16",
            accumulate=accumulate,
            schedule=schedule,
            nvme_path=[str(tmp_path)],
        ),
    )
    report = make_plan("tiny", dtype="bf16", accumulate=accumulate, schedule=schedule, **MACHINE)
    assert report.precision.grad_dtype is engine.parts.sizing.grad_dtype
    assert report.workload.grad_itemsize == engine.parts.sizing.workload(3).grad_itemsize


def test_the_memory_model_counts_grads_in_their_dtype() -> None:
    """Homes at 2 bytes a grad; the optimizer's grad pieces at 2 bytes, and the piece being
    stepped upcast to fp32 beside them (a torch allocation, not the pool)."""
    units = [("embedding", 4 * SHARD), ("blocks.0", SHARD), ("head", SHARD)]
    kw = {
        "compute_itemsize": 2,
        "device": "cpu",
        "prefetch_depth": 1,
        "piece_numel": SHARD,
        "overlap": False,
    }
    fp32, bf16 = (Workload.from_sizes(units, grad_itemsize=g, **kw) for g in (4, 2))
    trained = 6 * SHARD
    assert home_bytes(fp32, NVME)[Tier.NVME] - home_bytes(bf16, NVME)[Tier.NVME] == 2 * trained
    assert home_bytes(fp32, HOST)[Tier.HOST] - home_bytes(bf16, HOST)[Tier.HOST] == 2 * trained
    m32, m16 = peak_memory(fp32, NVME), peak_memory(bf16, NVME)
    pieces = 1 + 1  # one read ahead (depth 1) and one whose writes are in flight
    assert (
        m32.tiers[Tier.HOST].pooled["optimizer pieces"]
        - m16.tiers[Tier.HOST].pooled["optimizer pieces"]
        == pieces * SHARD * 2
    )
    # one small unit in compact state: the step's torch allocations (the kernel's chunk arrays,
    # 229 KB a core, and the upcast) outweigh backward's, so the step is the compute tier's peak
    int8 = StateBytes.for_compute("int8", "bf16", DType.BF16)
    small = SHARD // 32
    one32, one16 = (
        peak_memory(
            Workload.from_sizes([("blocks.0", small)], grad_itemsize=g, formats=int8, **kw),
            NVME,
        )
        for g in (4, 2)
    )
    assert one16.tiers[Tier.GPU].unpooled["grad upcast"] == small * 4
    assert "grad upcast" not in one32.tiers[Tier.GPU].unpooled


def test_plan_counts_bf16_grads_in_the_nvme_bytes_per_step() -> None:
    """7B, everything on NVMe, int8 moments and the bf16 master that is the param: a step
    writes and reads each grad once, 2 bytes each way instead of 4."""
    kw = dict(dtype="bf16", optimizer_state="int8", master="bf16", **MACHINE)
    one = make_plan("7b", **kw)
    vertical, horizontal = (
        make_plan("7b", accumulate=4, schedule=s, **kw) for s in ("vertical", "horizontal")
    )
    n = one.workload.state_shard_numel
    assert (
        one.placement == NVME
        and one.precision.grad_dtype is DType.BF16
        and horizontal.precision.grad_dtype is DType.FP32
    )
    moved, horizontally = (
        one.step_nvme_bytes()["horizontal"],
        horizontal.step_nvme_bytes(),
    )
    # per further micro-batch the params are read twice more and the fp32 grads read and
    # written again; and the one pass moves fp32 grads, 2 bytes each way more
    assert horizontally["horizontal"] - moved == 3 * 2 * (2 + 4) * n + 2 * 2 * n
    assert horizontally["vertical"] == vertical.step_nvme_bytes()["vertical"] == moved
    assert round(moved / one.numel, 2) == 16.06  # was 20.06 with fp32 grads


def test_plan_says_what_each_tier_holds_and_the_grad_dtype() -> None:
    from tierzero.cli.app import app

    args = [
        "plan",
        "--model",
        "tiny",
        "--dtype",
        "bf16",
        "--gpu-mem",
        "4GB",
        "--host-mem",
        "4GB",
        "--nvme-free",
        "1TB",
    ]
    report = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert report["state_formats"]["grad"] == "bf16"
    assert report["homes"]["kinds"]["grad"] in ("gpu", "host", "nvme")
    text = CliRunner().invoke(app, [*args, "--accumulate", "2", "--schedule", "horizontal"])
    assert text.exit_code == 0, text.output
    flat = " ".join(text.output.split())
    assert (
        "grad=fp32" in flat and "(grads fp32: the horizontal schedule adds each micro-batch" in flat
    )
    work = Workload.from_sizes(
        [("a", SHARD)],
        2,
        grad_itemsize=2,
        formats=StateBytes.for_compute("int8", "bf16", DType.BF16),
    )
    assert describe_homes(work, NVME, DType.BF16) == (
        "gpu: nothing; host: nothing; nvme: param=bf16 (the master too), "
        "grad=bf16, exp_avg=int8, exp_avg_sq=int8"
    )
