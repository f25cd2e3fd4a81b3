"""The swap plan for one pass over the units: data, printable and testable without a disk or GPU.

From the unit order (the embedding, the blocks and the head forward, then backward in reverse;
a model's root unit, if it has one, held for the pass) it lists, per use of a unit, the fetches
issued `prefetch_depth` uses ahead, the wait before compute, and the release after it. With
several ranks it lists each use's all-gather too (`gather`): issued one use ahead, as the
previous use begins computing, when `gather_ahead` is 1 (never further ahead than its fetch),
or just before its wait when 0. With replicated params (ZeRO stage 1/2) every rank stores whole
units: the plan lists no gathers and a fetch moves the whole unit.
`tierzero.engine.runtime.swaprunner` executes it.

The vertical schedule (`micro_batches`, gradient accumulation layer-major) is the same walk
over the units with each use covering every micro-batch of the step: one fetch, gather, wait
and release per use, and one compute op per micro-batch, which carries its index. The head has
no forward use there: it computes each micro-batch's loss inside its backward use.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tierzero.layout.partition import Unit, forward_only, forward_uses


class Op(str, enum.Enum):
    FETCH = "fetch"  # start moving a param shard from its home to the compute device
    WAIT = "wait"  # block until it is there
    GATHER = (
        "gather"  # start the all-gather of a unit's params from every rank's shard (several ranks)
    )
    COMPUTE = "compute"
    RELEASE = "release"  # drop the device copy (params never change during a pass)


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"  # the unit's forward recomputed, then its backward


@dataclass(frozen=True)
class SwapOp:
    op: Op
    unit: int
    phase: Phase
    micro: int | None = None  # the vertical schedule's compute ops: which micro-batch

    def __str__(self) -> str:
        micro = "" if self.micro is None else f" m{self.micro}"
        return f"{self.op.value:8s} u{self.unit}{micro} ({self.phase.value})"


@dataclass(frozen=True)
class SwapPlan:
    ops: tuple[SwapOp, ...]
    prefetch_depth: int

    def __str__(self) -> str:
        return "\n".join(str(op) for op in self.ops)

    def max_resident(self) -> int:
        """The most param shards on the device at once (fetched or in flight, not released)."""
        resident, peak = set(), 0
        for op in self.ops:
            if op.op is Op.FETCH:
                resident.add(op.unit)
            elif op.op is Op.RELEASE:
                resident.discard(op.unit)
            peak = max(peak, len(resident))
        return peak


def build_swap_plan(
    calls: list[tuple[int, ...]],
    prefetch_depth: int,
    backward: bool,
    held: frozenset[int] = frozenset(),
    forward_only: frozenset[int] = frozenset(),
    gather_ahead: int | None = None,
    micro_batches: int | None = None,
) -> SwapPlan:
    """The plan for one forward (and, when training, backward) pass.

    `calls` are the units each forward call binds, in order (`partition.forward_uses`: the
    head with the embedding when they are tied). Backward recomputes the calls in reverse.
    A call of `forward_only` units (a frozen embedding: no weight grad, and token ids need none)
    has no backward use. A `held` unit (the root of a model without embedding/head entry points)
    is fetched at its first use and released only at the end. A unit used again before its next
    fetch would be issued (the last call forward then first backward; a tied embedding) stays on
    the device.
    `gather_ahead` (several ranks): 1 issues each use's all-gather as the use before it starts
    computing, 0 just before its own wait, None lists no gathers (one rank). It is bounded by
    the fetch depth: a unit is gathered no earlier than it is fetched. `micro_batches` (the
    vertical schedule): the last call has no forward use, and each use computes that many
    micro-batches (see the module docstring).
    """
    if gather_ahead is not None and gather_ahead not in (0, 1):
        raise ValueError(f"gather_ahead must be 0, 1 or None, got {gather_ahead}")
    ahead = 0 if gather_ahead is None else min(gather_ahead, prefetch_depth)
    forward = calls[:-1] if micro_batches is not None else calls
    uses = [(call, Phase.FORWARD) for call in forward]
    if backward:
        uses += [
            (call, Phase.BACKWARD)
            for call in reversed(calls)
            if not set(call) & held and not set(call) <= forward_only
        ]
    ops: list[SwapOp] = []
    resident: set[int] = set()
    fetched_until = -1  # index into uses of the last use whose fetches have been issued
    gathered_until = -1  # likewise for all-gathers
    for i, (call, phase) in enumerate(uses):
        for j in range(fetched_until + 1, min(len(uses), i + prefetch_depth + 1)):
            for u in uses[j][0]:
                if u not in resident:
                    ops.append(SwapOp(Op.FETCH, u, uses[j][1]))
                    resident.add(u)
            fetched_until = j
        if gather_ahead is not None and gathered_until < i:  # this use's own, not issued ahead
            ops += [SwapOp(Op.GATHER, u, phase) for u in call]
            gathered_until = i
        for k, unit in enumerate(call):
            ops.append(SwapOp(Op.WAIT, unit, phase))
            if k == 0 and ahead and i + 1 < len(uses):  # the next use's, beside this one's compute
                ops += [SwapOp(Op.GATHER, u, uses[i + 1][1]) for u in uses[i + 1][0]]
                gathered_until = i + 1
            if micro_batches is None:
                ops.append(SwapOp(Op.COMPUTE, unit, phase))
            else:
                ops += [SwapOp(Op.COMPUTE, unit, phase, m) for m in range(micro_batches)]
        following = uses[i + 1][0] if i + 1 < len(uses) else ()
        for unit in call:
            if (
                unit not in held
                and unit not in following
                and not _used_again_soon(uses, i, unit, fetched_until)
            ):
                ops.append(SwapOp(Op.RELEASE, unit, phase))
                resident.discard(unit)
    ops += [SwapOp(Op.RELEASE, u, uses[-1][1]) for u in sorted(held)]
    return SwapPlan(tuple(ops), prefetch_depth)


def _used_again_soon(
    uses: list[tuple[tuple[int, ...], Phase]], i: int, unit: int, fetched_until: int
) -> bool:
    """Whether a later use of `unit` has already been fetched (so releasing it would be wrong)."""
    return any(unit in call for call, _ in uses[i + 1 : fetched_until + 1])


def swap_plans(
    units: list[Unit], prefetch_depth: int, gather_ahead: int | None, accumulate: int
) -> tuple[SwapPlan, SwapPlan, SwapPlan]:
    """A model's three plans: a training pass, an eval pass (forward only) and a vertical step
    of `accumulate` micro-batches."""
    calls, held = forward_uses(units), frozenset(u.index for u in units if u.is_root)
    skip = forward_only(units)
    return (
        build_swap_plan(calls, prefetch_depth, True, held, skip, gather_ahead),
        build_swap_plan(calls, prefetch_depth, False, held, gather_ahead=gather_ahead),
        build_swap_plan(
            calls, prefetch_depth, True, held, skip, gather_ahead, micro_batches=accumulate
        ),
    )


def step_nvme_bytes(
    one_pass: int,
    param_bytes: int,
    grad_bytes: int,
    accumulate: int,
    vertical: bool,
    spilled_bytes: int = 0,
) -> int:
    """NVMe bytes (read + written) of a step of `accumulate` micro-batches, from `one_pass`, those
    of a step of one (`planning.placement`'s moved bytes). Horizontally each further micro-batch
    reads the NVMe-homed params twice more (`param_bytes`: forward and backward) and reads back
    and writes again the NVMe-homed fp32 grads (`grad_bytes`); vertically a step moves what one
    micro-batch does, plus the waiting activations spilled to NVMe and read back."""
    if vertical:
        return one_pass + 2 * spilled_bytes
    return one_pass + (accumulate - 1) * 2 * (param_bytes + grad_bytes)
