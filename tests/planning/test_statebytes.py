"""Compact optimizer state in the plan: bytes per format by hand, the ledger's compact rows, the
memory model's homes and the planner's traffic per format, and a placement the format flips."""

from __future__ import annotations

import math

import pytest

from tierzero.config import STATE_BLOCK, DType, Placement, StateFormat, StateKind, Tier
from tierzero.errors import ConfigError
from tierzero.planning.ledger import format_rows, ledger
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.placement import Link, choose_placement, estimate
from tierzero.planning.planreport import make_plan
from tierzero.planning.statebytes import StateBytes
from tierzero.planning.workload import Workload

NVME = Placement(*[Tier.NVME] * 5)
PIECE_ALIGN = 2048  # what units and pieces are padded to
UNITS = [("a", 3 * PIECE_ALIGN), ("b", 5 * PIECE_ALIGN)]  # aligned: no padding, whole int8 blocks
N = 8 * PIECE_ALIGN
BLOCKS = N // STATE_BLOCK
MOMENT = {"fp32": 4, "bf16": 2, "int8": 1}
MASTER = {"fp32": 4, "bf16": 2}
COMBOS = [(m, w) for w in MASTER for m in MOMENT]


@pytest.mark.parametrize("moments", list(MOMENT))
def test_a_moment_takes_its_bytes_and_int8_one_scale_per_started_block(moments: str) -> None:
    f = StateBytes(moments)
    for n in (1, STATE_BLOCK, STATE_BLOCK + 1, 5 * STATE_BLOCK):
        scales = 4 * math.ceil(n / STATE_BLOCK) if moments == "int8" else 0
        assert (
            f.nbytes(StateKind.EXP_AVG, n, 2)
            == f.nbytes(StateKind.EXP_AVG_SQ, n, 2)
            == n * MOMENT[moments] + scales
        )
    assert StateBytes(master="bf16").nbytes(StateKind.MASTER, 10, 4) == 20
    assert f.nbytes(StateKind.GRAD, 10, 2, 4) == 40 and f.nbytes(StateKind.PARAM, 10, 2) == 20


def test_the_compact_rows_run_from_zeros_16_down_to_2_2_2() -> None:
    scale = 4 / STATE_BLOCK  # an int8 moment's fp32 absmax, per parameter
    rows = format_rows(DType.BF16)
    assert [(r.formats.optimizer_state.value, r.formats.master.value) for r in rows] == COMBOS
    assert [r.total for r in rows] == [16, 12, 10 + 2 * scale, 12, 8, 6 + 2 * scale]
    last = rows[-1]
    assert (last.weights, last.grads, last.moments) == (
        2,
        2,
        2 + 2 * scale,
    ) and last.formats.one_weight
    # fp32 compute: the bf16 master is a copy beside the fp32 param, never the param itself
    assert [r.total for r in format_rows(DType.FP32)] == [
        20,
        16,
        14 + 2 * scale,
        18,
        14,
        12 + 2 * scale,
    ]
    assert not any(r.formats.one_weight for r in format_rows(DType.FP32))


def test_the_stage_ledger_in_int8_with_one_bf16_weight() -> None:
    f = StateBytes.for_compute("int8", "bf16", DType.BF16)
    m = 2 + 8 / STATE_BLOCK  # both moments with their scales
    got = [r.bytes_per_param for r in ledger(10, 4, 2, f)]
    # stages 1-2 keep a whole param beside the master's share; DDP and stage 3 hold one weight
    assert got == pytest.approx(
        [2 + 2 + m, 2 + 2 + (2 + m) / 4, 2 + (2 + 2 + m) / 4, (2 + 2 + m) / 4]
    )
    assert [r.bytes_per_param for r in ledger(10, 1, 2, f)] == [6 + 8 / STATE_BLOCK] * 4


@pytest.mark.parametrize("moments, master", COMBOS)
def test_nvme_homes_hold_each_format_s_bytes(moments: str, master: str) -> None:
    f = StateBytes.for_compute(moments, master, DType.BF16)
    m = peak_memory(Workload.from_sizes(UNITS, 2, formats=f), NVME)
    param = 0 if f.one_weight else 2 * N  # bf16 compute and master: the master is the param
    scales = 4 * BLOCKS if moments == "int8" else 0
    assert m.tiers[Tier.NVME].homes_bytes == param + 4 * N + MASTER[master] * N + 2 * (
        MOMENT[moments] * N + scales
    )


@pytest.mark.parametrize("moments, master", COMBOS)
def test_nvme_bytes_per_step_follow_the_format(moments: str, master: str) -> None:
    """All on nvme, one rank: params read in forward and backward; grads written and read;
    master and moments read and written; the new param written unless it is the master."""
    f = StateBytes.for_compute(moments, master, DType.BF16)
    e = estimate(NVME, Workload.from_sizes(UNITS, 2, formats=f))
    state = MASTER[master] * N + 2 * (
        MOMENT[moments] * N + (4 * BLOCKS if moments == "int8" else 0)
    )
    assert e.moved_bytes[Link.NVME_TO_HOST] == 2 * 2 * N + 4 * N + state
    assert e.moved_bytes[Link.HOST_TO_NVME] == 4 * N + state + (0 if f.one_weight else 2 * N)


def test_one_weight_needs_the_param_and_master_homed_together_and_sharded_alike() -> None:
    f = StateBytes.for_compute("fp32", "bf16", DType.BF16)
    assert not StateBytes.for_compute("fp32", "bf16", DType.FP16).one_weight
    work = Workload.from_sizes(UNITS, 2, formats=f)
    assert work.one_weight(NVME) and not work.one_weight(Placement(Tier.GPU, *[Tier.NVME] * 4))
    assert not Workload.from_sizes(UNITS, 2, world_size=2, stage=2, formats=f).one_weight(NVME)
    apart = peak_memory(work, Placement(Tier.GPU, *[Tier.NVME] * 4))
    assert (
        apart.tiers[Tier.NVME].homes_bytes == (4 + 2 + 8) * N
    )  # grad, master, moments: the param on the gpu


def test_a_host_budget_that_holds_compact_state_but_not_fp32_moves_it_to_the_host() -> None:
    units = [
        ("embedding", 1 << 22),
        *[(f"blocks.{i}", 1 << 22) for i in range(4)],
        ("head", 1 << 22),
    ]

    def choice(f: StateBytes) -> Placement:
        work = Workload.from_sizes(units, 2, prefetch_depth=1, piece_numel=1 << 20, formats=f)
        c = choose_placement(work, gpu_budget=100 * 10**6, host_budget=250 * 10**6, nvme_free=None)
        assert c.fits
        return c.placement

    # 25.2M params: fp32 state on the host is 16 B/param (403 MB); int8 moments, bf16 master 8
    # (201 MB)
    assert choice(StateBytes()).master is Tier.NVME
    compact = choice(StateBytes.for_compute("int8", "bf16", DType.BF16))
    assert (compact.master, compact.exp_avg, compact.exp_avg_sq) == (Tier.HOST,) * 3


def test_plan_takes_the_formats_and_refuses_bad_ones_by_flag() -> None:
    kw = dict(
        gpu_mem="8GB", host_mem="16GB", nvme_free="1TB", dtype="bf16", batch_size=1, seq_len=64
    )
    fp32 = make_plan("125m", **kw)
    compact = make_plan("125m", optimizer_state="int8", master="bf16", **kw)
    assert compact.precision.formats == StateBytes(StateFormat.INT8, DType.BF16, one_weight=True)
    d = compact.as_dict()
    assert d["state_formats"] == {
        "optimizer_state": "int8",
        "master": "bf16",
        "one_weight": True,
        "text": compact.precision.formats.describe(),
        "grad": "bf16",
        "grad_reason": compact.precision.grad_reason,
    }
    assert [r["bytes_per_param"] for r in d["compact_ledger"] if r["chosen"]] == [
        6 + 8 / STATE_BLOCK
    ]
    assert d["ledger"][-1]["bytes_per_param"] == 6 + 8 / STATE_BLOCK
    assert fp32.as_dict()["ledger"][-1]["bytes_per_param"] == 16
    with pytest.raises(
        ConfigError, match=r"--optimizer-state 'int4' is not valid; choose one of fp32\|bf16\|int8"
    ):
        make_plan("125m", optimizer_state="int4", **kw)
    with pytest.raises(ConfigError, match="--master 'fp16'"):
        make_plan("125m", master="fp16", **kw)


def test_a_7b_that_fp32_state_cannot_fit_fits_in_compact_state_with_nothing_on_nvme() -> None:
    """24 GB of GPU, 64 GB of host memory, 80 GB of disk: fp32 state needs 80.9 GB of store;
    int8 moments and a bf16 master hold every optimizer state in the host (40.8 GB, bf16 grads)."""
    kw = dict(
        gpu_mem="24GB", host_mem="64GB", nvme_free="80GB", dtype="bf16", batch_size=8, seq_len=128
    )
    fp32 = make_plan("7b", **kw)
    compact = make_plan("7b", optimizer_state="int8", master="bf16", **kw)
    assert not fp32.choice.fits and fp32.choice.shortfall_bytes.keys() == {Tier.NVME}
    assert compact.choice.fits and compact.placement == Placement(Tier.GPU, *[Tier.HOST] * 4)
    assert compact.step_nvme_bytes() == {"horizontal": 0, "vertical": 0}
    n = compact.workload.state_shard_numel  # host homes: bf16 grads and master, int8 moments
    homes = compact.choice.estimate.memory.tiers[Tier.HOST].homes_bytes
    assert n * 6 <= homes <= n * 6 * 1.01
