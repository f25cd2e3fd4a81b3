"""The swap plan as data: every fetch precedes its use, nothing is used after release, and
the device never holds more param shards than the lookahead allows."""

from __future__ import annotations

import pytest

from tierzero.planning.swapplan import Op, build_swap_plan


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


def calls(n_blocks: int, tied: bool) -> list[tuple[int, ...]]:
    """The built-in model's calls: embedding, blocks, head (binding the embedding when tied)."""
    head = (n_blocks + 1, 0) if tied else (n_blocks + 1,)
    return [(0,)] + [(u,) for u in range(1, n_blocks + 1)] + [head]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("n_blocks", [1, 2, 5])
@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_training_plan_is_consistent_and_bounded(n_blocks: int, depth: int, tied: bool) -> None:
    plan = build_swap_plan(calls(n_blocks, tied), depth, backward=True)
    counts = replay(plan)
    # every call forward and backward; the tied head binds the embedding too
    assert counts["computes"] == 2 * (n_blocks + 2) + (2 if tied else 0)
    # the computing call, `depth` calls ahead, and a tied embedding kept for the head
    assert counts["peak"] <= depth + 1 + (2 if tied else 0)
    assert plan.max_resident() == counts["peak"]


def test_compute_order_is_forward_then_reverse() -> None:
    plan = build_swap_plan(calls(2, tied=True), 2, backward=True)
    order = [(op.unit, op.phase[0]) for op in plan.ops if op.op is Op.COMPUTE]
    assert order == [
        (0, "f"),
        (1, "f"),
        (2, "f"),
        (3, "f"),
        (0, "f"),
        (3, "b"),
        (0, "b"),
        (2, "b"),
        (1, "b"),
        (0, "b"),
    ]


def test_head_is_kept_between_forward_and_backward() -> None:
    plan = build_swap_plan(calls(3, tied=False), 1, backward=True)
    fetches = [op.unit for op in plan.ops if op.op is Op.FETCH]
    assert fetches.count(4) == 1 and fetches.count(1) == 2 and fetches.count(0) == 2


def test_a_root_unit_is_held_for_the_whole_pass() -> None:
    plan = build_swap_plan([(0,), (1,), (2,)], 1, backward=True, held=frozenset({0}))
    counts = replay(plan)
    assert counts["computes"] == 1 + 2 * 2  # root once, each block forward and backward
    releases = [op.unit for op in plan.ops if op.op is Op.RELEASE]
    assert releases[-1] == 0 and releases.count(0) == 1


def test_prefetch_runs_ahead_of_compute() -> None:
    plan = build_swap_plan(calls(4, tied=False), 2, backward=False)
    ops = list(plan.ops)
    first_compute_of_1 = next(i for i, op in enumerate(ops) if op.op is Op.COMPUTE and op.unit == 1)
    fetched_before = {op.unit for op in ops[:first_compute_of_1] if op.op is Op.FETCH}
    assert fetched_before == {0, 1, 2, 3}  # the embedding, the unit itself and two ahead


def test_eval_plan_has_no_backward() -> None:
    plan = build_swap_plan(calls(2, tied=False), 1, backward=False)
    assert {op.phase for op in plan.ops} == {"forward"}
    assert replay(plan)["computes"] == 4
    assert "fetch" in str(plan)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("ahead", [0, 1])
def test_gathers_are_ops_one_per_use_and_no_further_ahead_than_fetches(
    depth: int, ahead: int, tied: bool
) -> None:
    """Several ranks: each use's all-gather is listed once, after its unit's fetch and before its
    wait; issued ahead, it starts as the use before it starts computing, never earlier, and never
    before its fetch (so with depth 0 nothing is gathered ahead)."""
    plan = build_swap_plan(calls(3, tied), depth, backward=True, gather_ahead=ahead)
    replay(plan)
    resident: set[int] = set()
    pending: dict[int, int] = {}  # unit -> gathers issued and not yet used
    in_flight_max = 0
    for op in plan.ops:
        if op.op is Op.FETCH:
            resident.add(op.unit)
        elif op.op is Op.RELEASE:
            resident.discard(op.unit)
            assert not pending.get(op.unit), f"{op}: released with a gather not yet used"
        elif op.op is Op.GATHER:
            assert op.unit in resident, f"{op}: gathered before it was fetched"
            pending[op.unit] = pending.get(op.unit, 0) + 1
        elif op.op is Op.COMPUTE:
            assert pending.get(op.unit), f"{op}: computed without a gather"
            in_flight_max = max(in_flight_max, sum(pending.values()))
            pending[op.unit] -= 1
    assert not any(pending.values())
    gathers = sum(op.op is Op.GATHER for op in plan.ops)
    assert gathers == sum(op.op is Op.COMPUTE for op in plan.ops)
    # at a compute: its own gather and, issued ahead, the next use's (a tied head binds two units)
    assert in_flight_max <= (1 + (2 if tied else 1) * min(ahead, depth)) + (1 if tied else 0)


def test_a_gather_ahead_is_issued_as_the_use_before_starts_computing() -> None:
    ops = [
        (op.op.value, op.unit)
        for op in build_swap_plan(calls(1, False), 2, backward=False, gather_ahead=1).ops
    ]
    assert ops[ops.index(("wait", 0)) : ops.index(("compute", 0)) + 1] == [
        ("wait", 0),
        ("gather", 1),
        ("compute", 0),
    ]
    one_rank = build_swap_plan(calls(1, False), 2, backward=True)
    assert not any(op.op is Op.GATHER for op in one_rank.ops)
