"""Store keys: the name of every shard and piece a rank stores, and the shard range each holds.

One key per (state kind, unit, rank) for params; one per piece of the shard for the kinds the
optimizer streams (grad, master, Adam moments), so a piece can be read, stepped and written on
its own. Pure naming: no I/O.
"""

from __future__ import annotations

from tierzero.config import StateKind, Tier
from tierzero.layout.partition import Unit


def shard_key(kind: StateKind, unit: int, rank: int) -> str:
    return f"{kind.value}/u{unit:04d}/r{rank}"


def piece_key(kind: StateKind, unit: int, rank: int, piece: int) -> str:
    """Grads, master weights and Adam states are stored per piece of the shard."""
    return f"{shard_key(kind, unit, rank)}/p{piece:04d}"


def state_keys(
    kind: StateKind, unit: Unit, rank: int, piece_numel: int, home: Tier
) -> list[tuple[str, int, int]]:
    """This rank's keys of `kind` for `unit`, each with the shard range it holds: one key per
    piece (of the trainable prefix but for params: see `Unit.pieces`), except params in a memory
    tier: one key, viewed whole and in place by compute. Ranges are in the stored param's
    offsets for params (the whole flat buffer when `unit.replicated`), shard offsets otherwise."""
    if kind is StateKind.PARAM and home is not Tier.NVME:
        return [(shard_key(kind, unit.index, rank), 0, unit.param_numel)]
    pieces = (
        unit.param_pieces(piece_numel, rank)
        if kind is StateKind.PARAM
        else unit.pieces(piece_numel, rank)
    )
    return [(piece_key(kind, unit.index, rank, i), a, b) for i, (a, b) in enumerate(pieces)]
