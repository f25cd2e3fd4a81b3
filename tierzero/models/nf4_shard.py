"""`CodedShard`: the stored layout of a unit's param shard whose frozen weights are in NF4.

A param shard is stored as pieces (`Unit.param_pieces`): its trainable prefix's, then its
frozen rest's. With an NF4 base each piece of the frozen rest is stored in `tierzero.models.nf4`'s
format, its bytes padded to a multiple of 4 KiB (direct I/O moves every piece on its own) and
viewed as compute-dtype elements (a stored piece's byte size is a multiple of 4), so every
tier, transfer and checkpoint moves it as it moves any param: one array per piece on NVMe,
the pieces end to end in a memory tier's one key. The trainable prefix is stored as it is (the
optimizer writes it there piece by piece), so only frozen bytes shrink.

Decoding fills the unit's flat buffer of `param_numel` values. A fetch copies the stored
pieces to that buffer's tail and decodes them front to back into it: a piece never takes more
room decoded than stored, so piece i's values end before piece i + 1's stored bytes begin
(`CodedShard` checks it), and each piece is copied aside before it is decoded over itself.
Pure layout and arithmetic: no I/O.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from tierzero.config import Tier
from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit
from tierzero.models import nf4
from tierzero.storage.base import ALIGN_BYTES


@dataclass(frozen=True)
class StoredPiece:
    """One param piece: its values [lo, hi) and its stored elements [at, end) in the shard's
    stored layout; `blocks` marks its NF4 blocks (None: stored as values)."""

    lo: int
    hi: int
    at: int
    end: int
    blocks: torch.Tensor | None


class CodedShard:
    """A unit's param shard on one rank, its frozen rest's pieces in NF4."""

    def __init__(
        self,
        unit: Unit,
        rank: int,
        piece_numel: int,
        dtype: torch.dtype,
        mask: torch.Tensor | None = None,
    ) -> None:
        """`mask`: the unit's NF4 blocks (`QuantizedBlocks.mask`; by default found from its
        modules, which a checkpoint's reader has not: it passes `recorded_mask`'s)."""
        assert not unit.replicated, "an NF4 base is stored in shards (ZeRO stage 3)"
        self.unit, self.dtype = unit, dtype
        mask = nf4.QuantizedBlocks(unit).mask if mask is None else mask
        base = unit.shard_range(rank)[0]
        trainable = unit.state_numel(rank)
        self.pieces: list[StoredPiece] = []
        at = 0
        for lo, hi in unit.param_pieces(piece_numel, rank):
            first, last = (base + lo) // nf4.QUANT_BLOCK, (base + hi) // nf4.QUANT_BLOCK
            blocks = mask[first:last] if lo >= trainable else None
            if blocks is not None and blocks.any():
                nbytes = -(-nf4.stored_nbytes(blocks, dtype) // ALIGN_BYTES) * ALIGN_BYTES
                numel = nbytes // dtype.itemsize
            else:
                blocks, numel = None, hi - lo
            self.pieces.append(StoredPiece(lo, hi, at, at + numel, blocks))
            at += numel
        self.stored_numel = at
        self.param_numel = unit.param_numel
        tail = self.param_numel - self.stored_numel
        assert all(p.hi <= tail + q.at for p, q in zip(self.pieces, self.pieces[1:])), unit.name

    @property
    def stored_nbytes(self) -> int:
        return self.stored_numel * self.dtype.itemsize

    def tail(self, decoded: torch.Tensor) -> torch.Tensor:
        """Where a fetch lands the stored shard: the end of its decoded buffer."""
        return decoded[self.param_numel - self.stored_numel :]

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The shard's compute-dtype `values` (CPU, `param_numel` long) as stored."""
        out = torch.zeros(self.stored_numel, dtype=self.dtype)
        for p in self.pieces:
            if p.blocks is None:
                out[p.at : p.end] = values[p.lo : p.hi]
            else:
                packed = nf4.encode(values[p.lo : p.hi], p.blocks)
                out[p.at : p.end].view(torch.uint8)[: packed.numel()] = packed
        return out

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (`param_numel` values on the compute device) from the stored shard; `stored`
        may be `out`'s own tail (a fetch lands there): a piece whose values land over its own
        stored bytes is copied aside first (at most one piece's stored bytes at a time)."""
        for p in self.pieces:
            piece = stored[p.at : p.end]
            if _overlaps(piece, out[p.lo : p.hi]):
                piece = piece.clone()
            if p.blocks is None:
                out[p.lo : p.hi] = piece
            else:
                nbytes = nf4.stored_nbytes(p.blocks, self.dtype)
                nf4.decode(piece.view(torch.uint8)[:nbytes], p.blocks, out[p.lo : p.hi])
        return out

    def stored_range(self, lo: int, hi: int) -> tuple[int, int]:
        """The stored elements of the pieces that hold the values [lo, hi) (piece bounds)."""
        first = next(p for p in self.pieces if p.lo == lo)
        last = next(p for p in self.pieces if p.hi == hi)
        return first.at, last.end


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def coded_base(
    quantize_base: str,
    piece_numel: int,
    units: list[Unit],
    param_home: Tier,
    world_size: int,
    dtype: torch.dtype,
) -> dict[int, CodedShard]:
    """The units `quantize_base` stores coded (none without it), or a refusal naming
    what an NF4 base needs: bitsandbytes, a frozen base, one rank, params homed off the GPU."""
    if quantize_base == "none":
        return {}
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            "--quantize-base nf4 codes the base with bitsandbytes, which is not "
            "installed; pip install bitsandbytes, or drop --quantize-base"
        )
    if world_size > 1:
        raise ConfigError(
            "--quantize-base nf4 trains on one rank for now; drop --gpus or --quantize-base"
        )
    if param_home is Tier.GPU:
        raise ConfigError(
            "--quantize-base nf4 stores the base on the host or NVMe and decodes "
            "each unit on the GPU as it is fetched, but this plan keeps params on "
            "the GPU; pass --offload host or --offload nvme"
        )
    found = coded_shards(units, 0, piece_numel, dtype)
    if not found:
        raise ConfigError(
            "--quantize-base nf4 stores a frozen base's linear weights in 4 bits, "
            "and this model's blocks have none frozen; train adapters (--lora-r) "
            "or drop --quantize-base"
        )
    return found


def coded_shards(
    units: list[Unit], rank: int, piece_numel: int, dtype: torch.dtype
) -> dict[int, CodedShard]:
    """Each unit whose shard holds NF4 blocks, by index: the units an NF4 base stores coded."""
    found = {}
    for unit in units:
        if nf4.QuantizedBlocks(unit).quantized_numel:
            shard = CodedShard(unit, rank, piece_numel, dtype)
            if any(p.blocks is not None for p in shard.pieces):
                found[unit.index] = shard
    return found


def recorded_weights(shards: dict[int, CodedShard]) -> dict[str, list[str]]:
    """Each coded unit's NF4 weights by name, for a checkpoint's manifest (its reader decodes
    with `recorded_mask`)."""
    return {
        str(index): [
            s.names[0]
            for s in shard.unit.slots
            if nf4.quantizable(shard.unit, *s.module_attrs[0], s.frozen)
        ]
        for index, shard in shards.items()
    }


def recorded_mask(
    padded_numel: int, slots: list[tuple[str, int, int]], names: list[str]
) -> torch.Tensor:
    """A unit's NF4 blocks from its slots' (name, offset, numel) and the names recorded coded."""
    mask = torch.zeros(padded_numel // nf4.QUANT_BLOCK, dtype=torch.bool)
    wanted = set(names)
    for name, offset, numel in slots:
        if name in wanted:
            mask[offset // nf4.QUANT_BLOCK : (offset + numel) // nf4.QUANT_BLOCK] = True
    return mask
