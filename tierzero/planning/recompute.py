"""Which units keep their activations from forward to backward instead of being recomputed.

Activation checkpointing runs every unit's forward twice: once without grad (only its input
is kept) and again in backward. A unit whose saved tensors fit the compute device's budget can
instead keep the autograd graph of its one forward until its backward, which skips the second
forward (a third of a block's compute per step, a quarter of the head's). What each kept unit
holds is counted from the shape (`ActivationEstimate.block_kept_bytes` for a block,
`head_kept_bytes` for the head), or, for a model the engine trains whose shape says nothing of
its activations (a Hugging Face decoder, dense or a mixture of experts), measured on the first
step's recomputes (`tierzero.engine.runtime.kept`) and given as `sizes`. Units are kept in
order of the compute they save per byte kept (a unit's FLOPs per token are twice its parameter
count; ties go to the later unit, whose graph is freed first in backward) while they fit. The
embedding (a lookup, nothing to save) and a head tied to it are always recomputed.

In the vertical schedule every kept block holds one graph per micro-batch, each with its input,
from the forward sweep to the backward sweep (k times a horizontal graph and a hidden state);
the head is not a candidate there, as it runs once, in backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tierzero.config import Recompute
from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit
from tierzero.planning.ledger import ActivationEstimate

Sizes = Mapping[int, int]  # unit index -> what its kept graphs hold, measured


def kept_bytes(unit: Unit, act: ActivationEstimate | None, sizes: Sizes | None = None) -> int:
    """What `unit`'s kept graphs hold from its forward to its backward."""
    if sizes is not None:
        return max(1, sizes[unit.index])
    assert act is not None, "kept graphs are sized from the shape or measured"
    return max(1, act.head_kept_bytes if unit.kind == "head" else act.block_kept_bytes)


def keepable(
    units: Sequence[Unit],
    act: ActivationEstimate | None,
    forward_only: frozenset[int] = frozenset(),
    sizes: Sizes | None = None,
) -> list[Unit]:
    """The units that can keep their graph, most compute saved per byte kept first (`sizes`:
    only those measured)."""
    kinds = ("block",) if act is not None and act.vertical else ("block", "head")
    able = [
        u
        for u in units
        if u.kind in kinds
        and not u.uses_with
        and u.index not in forward_only
        and (sizes is None or u.index in sizes)
    ]
    return sorted(able, key=lambda u: (-u.numel / kept_bytes(u, act, sizes), -u.index))


def choose_kept(
    recompute: Recompute,
    units: Sequence[Unit],
    act: ActivationEstimate | None,
    room_bytes: int,
    forward_only: frozenset[int] = frozenset(),
    sizes: Sizes | None = None,
) -> frozenset[int]:
    """The units that keep their graph under `recompute` with `room_bytes` of the compute
    device's budget left beyond everything else: `auto` those that fit, in `keepable`'s order;
    `none` every one, or a refusal; `all` none. `sizes`: measured graphs, else `act`'s."""
    if recompute is Recompute.ALL:
        return frozenset()
    candidates = keepable(units, act, forward_only, sizes)
    if recompute is Recompute.NONE:
        need = sum(kept_bytes(u, act, sizes) for u in candidates)
        if need > room_bytes:
            raise ConfigError(
                f"--recompute none keeps {len(candidates)} units' activations "
                f"({need / 1e6:.1f} MB) "
                f"but the compute device's budget has {max(0, room_bytes) / 1e6:.1f} MB left for "
                "them; use --recompute auto, smaller batches or a larger budget"
            )
        return frozenset(u.index for u in candidates)
    kept, used = [], 0
    for u in candidates:
        if used + kept_bytes(u, act, sizes) <= room_bytes:
            kept.append(u.index)
            used += kept_bytes(u, act, sizes)
    return frozenset(kept)


def with_kept(
    act: ActivationEstimate, units: Sequence[Unit], kept: frozenset[int]
) -> ActivationEstimate:
    """`act` counting the graphs of the `kept` units."""
    kinds = [units[i].kind for i in kept]
    return dataclasses.replace(act, kept_blocks=kinds.count("block"), kept_head="head" in kinds)
