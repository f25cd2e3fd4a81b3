"""`tierzero plan` with `--schedule`: which schedule a step runs and its NVMe bytes under both.

Counted, not timed: with grads on NVMe each further micro-batch of a horizontal step reads the
fp32 grads back and writes them again, so horizontal moves `2 x (k-1) x fp32 grad bytes` more
than a step of one micro-batch, whose grads (bf16 with bf16 compute) are written and read once;
vertical moves what one micro-batch does while its waiting activations fit the host's room.
"""

from __future__ import annotations

import pytest

from tierzero.config import StateKind, Tier
from tierzero.errors import ConfigError
from tierzero.planning.planreport import make_plan

MACHINE = dict(host_mem="1GB", gpu_mem="1GB", nvme_free="1TB", seq_len=64, vocab_size=8192)


def test_vertical_moves_one_micro_batchs_bytes_per_step() -> None:
    report = make_plan("350m", accumulate=4, schedule="vertical", **MACHINE)
    assert report.vertical and report.as_dict()["schedule"]["schedule"] == "vertical"
    w, p = report.workload, report.placement
    assert p.grad is Tier.NVME and p.param is not Tier.NVME  # the case counted here
    moved = report.step_nvme_bytes()
    one = make_plan("350m", accumulate=1, **MACHINE).step_nvme_bytes()
    assert moved["vertical"] == one["vertical"] == one["horizontal"]
    # vertical stores bf16 grads (each written once a step); horizontal accumulates in fp32
    assert w.nbytes(StateKind.GRAD) == 2
    fp32, bf16 = 4 * w.state_shard_numel, 2 * w.state_shard_numel
    assert moved["horizontal"] - moved["vertical"] == 2 * 3 * fp32 + 2 * (fp32 - bf16)


def test_auto_is_vertical_only_when_accumulating() -> None:
    assert make_plan("125m", accumulate=4, schedule="auto", **MACHINE).vertical
    assert not make_plan("125m", accumulate=1, schedule="auto", **MACHINE).vertical
    assert make_plan("125m", accumulate=4, **MACHINE).vertical  # auto is the default
    assert not make_plan("125m", accumulate=4, schedule="horizontal", **MACHINE).vertical


def test_a_bad_schedule_is_one_sentence() -> None:
    with pytest.raises(ConfigError, match="--schedule 'sideways' is not valid"):
        make_plan("125m", schedule="sideways", **MACHINE)
