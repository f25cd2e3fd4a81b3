"""How state streams through the budgets: the piece size and prefetch depth that fit them.

Owns `Streaming` (elements per piece, units fetched ahead), the ladder of candidates tried
when a user leaves them to the engine (`Config.piece_numel` / `prefetch_depth` of None), and
`choose_streaming`: the first candidate of the ladder whose memory model
(`tierzero.planning.memory_model.peak_memory`) fits the memory budgets, or the shortfall at
the ladder's smallest setting. Plain data in, a choice out: it never probes the machine.

The ladder's order is the preference. Pieces are the drive's request size (a piece of fp32
state is one read or write), so they stay at `MIN_REQUEST_BYTES` or more while anything fits
there: the largest pieces first, and for each the deepest read-ahead. Smaller pieces come
next, and a prefetch depth of 0 (each fetch waits, nothing overlaps compute) last of all.
The default (16 Mi elements, depth 2) is the ladder's top, so a roomy budget changes nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tierzero.config import PIECE_NUMEL, PREFETCH_DEPTH, Placement, Tier
from tierzero.planning.ledger import FP32_NBYTES
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.peaks import MemoryModel, format_bytes
from tierzero.planning.workload import Workload

MIN_REQUEST_BYTES = 1 << 20  # below 1 MiB per request an NVMe drive's bandwidth falls off
SMALLEST_PIECE_NUMEL = 64 << 10  # 256 KiB of fp32: the ladder's last rung, when nothing larger fits
DEPTHS = tuple(range(PREFETCH_DEPTH, -1, -1))  # 2, 1, 0


@dataclass(frozen=True)
class Streaming:
    """Elements per piece (grads and optimizer states stream in these) and units fetched ahead."""

    piece_numel: int
    prefetch_depth: int

    def describe(self) -> str:
        """`pieces of 1 Mi elements (4.2 MB of fp32), prefetch depth 1`."""
        return (f"pieces of {_binary(self.piece_numel)} elements "
                f"({format_bytes(self.piece_numel * FP32_NBYTES)} of fp32), prefetch depth {self.prefetch_depth}")


@dataclass(frozen=True)
class Shortfall:
    """Nothing on the ladder fits: at its smallest setting (`streaming`), each short tier's need
    and budget (bytes, as `MemoryModel.needs` counts them against the budgets given)."""

    streaming: Streaming
    need_bytes: dict[Tier, int]
    budget_bytes: dict[Tier, int]


def ladder(piece_numel: int | None = None, prefetch_depth: int | None = None) -> list[Streaming]:
    """The candidates in order of preference; a value the user set is the only one of its kind."""
    pieces = [piece_numel] if piece_numel is not None else \
        [PIECE_NUMEL >> i for i in range(PIECE_NUMEL.bit_length()) if PIECE_NUMEL >> i >= SMALLEST_PIECE_NUMEL]
    depths = [prefetch_depth] if prefetch_depth is not None else list(DEPTHS)
    candidates = [Streaming(p, d) for p in pieces for d in depths]
    return sorted(candidates, key=lambda s: (s.prefetch_depth == 0 and prefetch_depth is None,
                                            s.piece_numel * FP32_NBYTES < MIN_REQUEST_BYTES and piece_numel is None,
                                            -s.piece_numel, -s.prefetch_depth))


def choose_streaming(work: Workload, placement: Placement, budgets: dict[Tier, int | None], *,
                     piece_numel: int | None = None, prefetch_depth: int | None = None,
                     per_rank: bool = False) -> Streaming | Shortfall:
    """The first setting of the ladder (`piece_numel` / `prefetch_depth` fixed where given)
    under which `work` at `placement` fits `budgets` (bytes per tier; a tier absent or None is
    unbounded), or the `Shortfall` at the last. `work`'s own piece size and depth are ignored.
    Budgets compare with `MemoryModel.needs()`: machine-wide host and nvme figures, or with
    `per_rank` one rank's share (as the engine's per-rank budgets are)."""
    for streaming in ladder(piece_numel, prefetch_depth):
        need = streamed_memory(work, placement, streaming, per_rank).needs()
        over = [t for t, b in budgets.items() if b is not None and need[t] > b]
        if not over:
            return streaming
    return Shortfall(streaming, {t: need[t] for t in over}, {t: budgets[t] or 0 for t in over})


def streamed(work: Workload, streaming: Streaming) -> Workload:
    """`work` with `streaming`'s piece size and prefetch depth."""
    return dataclasses.replace(work, piece_numel=streaming.piece_numel, prefetch_depth=streaming.prefetch_depth)


def streamed_memory(work: Workload, placement: Placement, streaming: Streaming, per_rank: bool = False) -> MemoryModel:
    memory = peak_memory(streamed(work, streaming), placement)
    return memory.per_rank() if per_rank else memory


def _binary(n: int) -> str:
    """`16 Mi`, `256 Ki`, `3072`: an element count as the ladder writes it."""
    for suffix, scale in (("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {suffix}"
    return str(n)
