"""Which blocks keep their activations from forward to backward instead of being recomputed.

Activation checkpointing runs every unit's forward twice: once without grad (only its input
is kept) and again in backward. A block whose saved tensors fit the compute device's budget
can instead keep the autograd graph of its one forward until its backward, which skips the
second forward (a third of a block's compute per step). Each kept block holds
`ActivationEstimate.recompute_bytes`: what its forward saves for backward, counted from the
shape. The blocks kept are those that save the most compute per byte kept (a block's FLOPs per
token grow with its parameter count; ties go to the later block, whose graph is freed first in
backward). Only the built-in model's blocks are counted, so only they are kept; the embedding
and head (cheap to recompute, or recomputed chunk by chunk by the loss) are always recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierzero.config import Recompute
from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit
from tierzero.planning.ledger import ActivationEstimate


def keepable(units: Sequence[Unit], forward_only: frozenset[int] = frozenset()) -> list[Unit]:
    """The blocks that can keep their graph, most compute saved per byte kept first."""
    blocks = [u for u in units if u.kind == "block" and not u.uses_with and u.index not in forward_only]
    return sorted(blocks, key=lambda u: (-u.numel, -u.index))


def kept_count(recompute: Recompute, candidates: int, act: ActivationEstimate, room_bytes: int) -> int:
    """How many blocks keep their graph under `recompute` with `room_bytes` of the compute
    device's budget left beyond everything else: `auto` as many as fit, `none` all of them or
    a refusal, `all` none."""
    if recompute is Recompute.ALL or candidates == 0:
        return 0
    per = max(1, act.recompute_bytes)
    if recompute is Recompute.NONE:
        if candidates * per > room_bytes:
            raise ConfigError(f"--recompute none keeps {candidates} blocks' activations ({candidates * per / 1e6:.1f} "
                              f"MB) but the compute device's budget has {max(0, room_bytes) / 1e6:.1f} MB left for "
                              "them; use --recompute auto, smaller batches or a larger budget")
        return candidates
    return min(candidates, max(0, room_bytes) // per)


def kept_units(units: Sequence[Unit], count: int, forward_only: frozenset[int] = frozenset()) -> frozenset[int]:
    """The indices of the `count` blocks kept (`keepable`'s first)."""
    return frozenset(u.index for u in keepable(units, forward_only)[:count])
