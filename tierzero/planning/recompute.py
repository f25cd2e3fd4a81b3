"""Which units keep their activations from forward to backward instead of being recomputed.

Activation checkpointing runs every unit's forward twice: once without grad (only its input
is kept) and again in backward. A unit whose saved tensors fit the compute device's budget can
instead keep the autograd graph of its one forward until its backward, which skips the second
forward (a third of a block's compute per step, a quarter of the head's). What each kept unit
holds is counted from the shape (`ActivationEstimate.recompute_bytes` for a block,
`head_kept_bytes` for the head). Units are kept in order of the compute they save per byte
kept (a unit's FLOPs per token are twice its parameter count; ties go to the later unit, whose
graph is freed first in backward) while they fit. Only the built-in model's blocks and its
untied head are counted, so only they are kept; the embedding (a lookup, nothing to save) and a
head tied to it are always recomputed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tierzero.config import Recompute
from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit
from tierzero.planning.ledger import ActivationEstimate


def kept_bytes(unit: Unit, act: ActivationEstimate) -> int:
    """What `unit`'s kept graph holds from its forward to its backward."""
    return max(1, act.head_kept_bytes if unit.kind == "head" else act.recompute_bytes)


def keepable(
    units: Sequence[Unit], act: ActivationEstimate, forward_only: frozenset[int] = frozenset()
) -> list[Unit]:
    """The units that can keep their graph, most compute saved per byte kept first."""
    able = [
        u
        for u in units
        if u.kind in ("block", "head") and not u.uses_with and u.index not in forward_only
    ]
    return sorted(able, key=lambda u: (-u.numel / kept_bytes(u, act), -u.index))


def choose_kept(
    recompute: Recompute,
    units: Sequence[Unit],
    act: ActivationEstimate,
    room_bytes: int,
    forward_only: frozenset[int] = frozenset(),
) -> frozenset[int]:
    """The units that keep their graph under `recompute` with `room_bytes` of the compute
    device's budget left beyond everything else: `auto` those that fit, in `keepable`'s order;
    `none` every one, or a refusal; `all` none."""
    if recompute is Recompute.ALL:
        return frozenset()
    candidates = keepable(units, act, forward_only)
    if recompute is Recompute.NONE:
        need = sum(kept_bytes(u, act) for u in candidates)
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
        if used + kept_bytes(u, act) <= room_bytes:
            kept.append(u.index)
            used += kept_bytes(u, act)
    return frozenset(kept)


def with_kept(
    act: ActivationEstimate, units: Sequence[Unit], kept: frozenset[int]
) -> ActivationEstimate:
    """`act` counting the graphs of the `kept` units."""
    kinds = [units[i].kind for i in kept]
    return dataclasses.replace(act, kept_blocks=kinds.count("block"), kept_head="head" in kinds)
