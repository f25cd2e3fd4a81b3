"""The swap plan as data: every fetch precedes its use, nothing is used after release, and
the device never holds more param shards than the lookahead allows."""

from __future__ import annotations

import pytest

from tierzero.schedule import Op, build_swap_plan


def replay(plan) -> dict[str, int]:
    resident: set[int] = set()
    peak = computes = 0
    for op in plan.ops:
        if op.op is Op.FETCH:
            assert op.unit not in resident, f"{op}: fetched twice"
            resident.add(op.unit)
        elif op.op is Op.WAIT:
            assert op.unit in resident, f"{op}: waited on a unit never fetched"
        elif op.op is Op.COMPUTE:
            assert op.unit in resident, f"{op}: computed on a released unit"
            computes += 1
        elif op.op is Op.RELEASE:
            resident.remove(op.unit)
        peak = max(peak, len(resident))
    assert not resident, "the pass must end with nothing resident"
    return {"peak": peak, "computes": computes}


@pytest.mark.parametrize("n_blocks", [1, 2, 5])
@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_training_plan_is_consistent_and_bounded(n_blocks: int, depth: int) -> None:
    plan = build_swap_plan(n_blocks, depth, backward=True)
    counts = replay(plan)
    assert counts["computes"] == 1 + 2 * n_blocks  # root once, each block forward and backward
    assert counts["peak"] <= depth + 2  # the held root + the computing unit + `depth` ahead
    assert plan.max_resident() == counts["peak"]


def test_compute_order_is_forward_then_reverse() -> None:
    plan = build_swap_plan(3, 2, backward=True)
    order = [(op.unit, op.phase) for op in plan.ops if op.op is Op.COMPUTE]
    assert order == [(0, "forward"), (1, "forward"), (2, "forward"), (3, "forward"),
                     (3, "backward"), (2, "backward"), (1, "backward")]


def test_last_block_is_kept_between_forward_and_backward() -> None:
    plan = build_swap_plan(3, 1, backward=True)
    fetches = [op.unit for op in plan.ops if op.op is Op.FETCH]
    assert fetches.count(3) == 1 and fetches.count(1) == 2 and fetches.count(0) == 1


def test_prefetch_runs_ahead_of_compute() -> None:
    plan = build_swap_plan(4, 2, backward=False)
    ops = list(plan.ops)
    first_compute_of_1 = next(i for i, op in enumerate(ops) if op.op is Op.COMPUTE and op.unit == 1)
    fetched_before = {op.unit for op in ops[:first_compute_of_1] if op.op is Op.FETCH}
    assert fetched_before == {0, 1, 2, 3}  # root, the unit itself and two ahead


def test_eval_plan_has_no_backward() -> None:
    plan = build_swap_plan(2, 1, backward=False)
    assert {op.phase for op in plan.ops} == {"forward"}
    assert replay(plan)["computes"] == 3
    assert "fetch" in str(plan)
