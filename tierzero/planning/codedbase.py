"""The coded base: what a frozen base stored in NF4 (`--quantize-base nf4`) takes in every tier.

The engine stores a unit's param shard as pieces (`Unit.param_pieces`): the trainable prefix's
as values, then the frozen rest's, each of those coded in `tierzero.models.nf4`'s format where
it holds NF4 blocks -- an fp32 absmax and 32 code bytes per 64 values inside a quantised weight
(0.5625 bytes a value), every other block as values -- padded to a multiple of 4 KiB
(`tierzero.models.nf4_shard.CodedShard`). A coded shard is fetched, staged, cached, homed and
checkpointed at those bytes; only its device buffer holds the decoded values. What is quantised
is `nf4.quantizable`'s: a frozen plain linear layer's weight in a block, as bitsandbytes
replaces them; the embedding, norms, biases, the head and the adapters stay in the compute dtype.

`CodedBase` keeps, per unit, the value ranges its NF4 weights cover (a few per block), not the
block masks the engine builds: a 405B model's masks would take gigabytes, and the planner asks
for every candidate placement and streaming setting. A piece's stored bytes follow from how
many of its blocks those ranges cover; blocks of one shape share one count (`_piece_counts`
is cached), so the pieces are counted per size, never listed. Arithmetic: it allocates no
tensor, and `tests/planning/test_coded_base.py` holds it to `CodedShard`'s layout.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit
from tierzero.models.nf4 import QUANT_BLOCK, quantizable
from tierzero.storage.base import ALIGN_BYTES

NF4_BLOCK_NBYTES = 4 + QUANT_BLOCK // 2  # an fp32 absmax and 64 codes of 4 bits
NF4_BYTES_PER_PARAM = NF4_BLOCK_NBYTES / QUANT_BLOCK  # 0.5625

Ranges = tuple[tuple[int, int], ...]  # [lo, hi) value ranges of a unit's flat buffer


@dataclass(frozen=True)
class CodedBase:
    """Per unit (by index), the [lo, hi) ranges of its flat param buffer held in NF4 weights:
    multiples of 64 values, in order, merged where they touch."""

    ranges: tuple[Ranges, ...]

    @classmethod
    def of(cls, units: Sequence[Unit]) -> CodedBase:
        """The NF4 weights of `units` (a model partitioned with its frozen base), or the
        refusal `tierzero train --quantize-base nf4` gives when a weight does not fill whole
        64-value blocks or no block has a frozen linear weight."""
        found = cls(tuple(_unit_ranges(u) for u in units))
        if not found.quantized_numel:
            raise ConfigError(
                "--quantize-base nf4 stores a frozen base's linear weights in 4 bits, "
                "and this model's blocks have none frozen; train adapters (--lora-r) "
                "or drop --quantize-base"
            )
        return found

    @property
    def quantized_numel(self) -> int:
        """Values stored in NF4, every unit's."""
        return sum(hi - lo for unit in self.ranges for lo, hi in unit)

    def is_coded(self, unit: Unit) -> bool:
        """Whether `unit`'s shard holds NF4 blocks in its frozen rest (rank 0's, the only one)."""
        return any(hi > unit.trainable_numel for _, hi in self.ranges[unit.index])

    def piece_counts(self, unit: Unit, piece_numel: int, itemsize: int) -> Counter[int]:
        """Rank 0's param pieces of `unit` as stored: bytes -> how many pieces, each trained
        piece as values, each frozen one coded where it holds NF4 blocks (`CodedShard`)."""
        start = unit.state_numel(0)
        counts = _piece_counts((), 0, start, piece_numel, itemsize)
        frozen = _piece_counts(
            self.ranges[unit.index], start, unit.shard_numel, piece_numel, itemsize
        )
        return Counter(dict(counts)) + Counter(dict(frozen))

    def shard_nbytes(self, unit: Unit, piece_numel: int, itemsize: int) -> int:
        """Rank 0's param shard of `unit` as stored: its pieces end to end."""
        return sum(n * k for n, k in self.piece_counts(unit, piece_numel, itemsize).items())


def _unit_ranges(unit: Unit) -> Ranges:
    """The ranges of `unit`'s flat buffer that hold NF4 weights, merged."""
    ranges: list[tuple[int, int]] = []
    for slot in sorted(unit.slots, key=lambda s: s.offset):
        if not quantizable(unit, *slot.module_attrs[0], slot.frozen):
            continue
        if slot.offset % QUANT_BLOCK or slot.numel % QUANT_BLOCK:
            raise ConfigError(
                f"{slot.names[0]} ({slot.numel} values at {slot.offset} in its unit) "
                f"does not fill whole blocks of {QUANT_BLOCK} values, so its NF4 codes "
                "would not be bitsandbytes'; keep this model's base in the compute dtype"
            )
        if ranges and ranges[-1][1] == slot.offset:
            ranges[-1] = (ranges[-1][0], slot.end)
        else:
            ranges.append((slot.offset, slot.end))
    return tuple(ranges)


@functools.lru_cache(maxsize=256)
def _piece_counts(
    ranges: Ranges, lo: int, hi: int, piece_numel: int, itemsize: int
) -> tuple[tuple[int, int], ...]:
    """The pieces of [lo, hi) cut every `piece_numel` values from `lo` (the last shorter) as
    stored: (bytes, how many) per size. A piece with NF4 blocks is coded and padded to
    `ALIGN_BYTES`; one without is its values."""
    if hi <= lo:
        return ()
    bounds = np.append(np.arange(lo, hi, piece_numel, dtype=np.int64), hi)
    covered = np.zeros(len(bounds), dtype=np.int64)  # NF4 values in [lo, bound)
    for a, b in ranges:
        covered += np.clip(bounds, a, b) - a
    coded = np.diff(covered) // QUANT_BLOCK  # each piece's NF4 blocks
    numel = np.diff(bounds)
    raw = (numel - coded * QUANT_BLOCK) * itemsize
    stored = coded * NF4_BLOCK_NBYTES + raw
    padded = -(-stored // ALIGN_BYTES) * ALIGN_BYTES
    nbytes = np.where(coded > 0, padded, numel * itemsize)
    sizes, counts = np.unique(nbytes, return_counts=True)
    return tuple(zip(sizes.tolist(), counts.tolist()))
