"""How state streams through the budgets: the piece size and prefetch depth that fit them.

Owns `Streaming` (elements per piece, units fetched ahead), the ladder of settings tried when a
user leaves them to the engine (`Config.piece_numel` / `prefetch_depth` of None), and
`choose_streaming`: the defaults where the memory model (`memory_model.peak_memory`) fits the
budgets with them, else the first rung of the ladder that fits, else the shortfall. Plain data
in, a choice out: it never probes the machine, and `tierzero plan` asks it what the engine asks.

The ladder's order is the preference. A piece of fp32 state is one read or write to the drive,
so pieces stay at `MIN_REQUEST_BYTES` or more while anything fits there: the largest pieces
first, each at the deepest read-ahead, then smaller pieces. A prefetch depth of 0 is never
chosen -- every fetch would then wait in the open, the compute device idle -- only given.
The engine (`Sizing.walks`) and `tierzero plan` ask it only where nothing fits stage 3 at the
defaults, so budgets the defaults fit keep every choice they made before (placement, stage).

Cheap by construction, since the planner asks it for every candidate placement: defaults that
fit are kept after one evaluation (a roomy budget changes nothing); a budget below the homes
alone (`homes.homes_floor`, a few sums) fits no rung and walks none; one below the
ladder's last rung, the least it needs, walks none either. Each evaluation is arithmetic on
unit sizes (pieces counted per size, never listed), so the walk costs at most `len(ladder())`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tierzero.config import PIECE_NUMEL, PREFETCH_DEPTH, Placement, Tier
from tierzero.planning.homes import homes_floor
from tierzero.planning.ledger import FP32_NBYTES
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.peaks import format_bytes
from tierzero.planning.workload import Workload

MIN_REQUEST_BYTES = 1 << 20  # below 1 MiB per request an NVMe drive's bandwidth falls off
SMALLEST_PIECE_NUMEL = 64 << 10  # 256 KiB of fp32: the ladder's last rung, when nothing larger fits
DEPTHS = tuple(range(PREFETCH_DEPTH, 0, -1))  # 2, 1: the read-aheads the engine chooses


@dataclass(frozen=True)
class Streaming:
    """Elements per piece (grads and optimizer states stream in these) and units fetched ahead."""

    piece_numel: int
    prefetch_depth: int

    def describe(self) -> str:
        """`pieces of 1 Mi elements (4.2 MB of fp32), prefetch depth 1`."""
        return (
            f"pieces of {_binary(self.piece_numel)} elements "
            f"({format_bytes(self.piece_numel * FP32_NBYTES)} of fp32), "
            f"prefetch depth {self.prefetch_depth}"
        )


DEFAULT = Streaming(PIECE_NUMEL, PREFETCH_DEPTH)


@dataclass(frozen=True)
class Shortfall:
    """Nothing on the ladder fits: the setting the needs were counted at (`streaming`: the
    ladder's last rung, the least it needs; or its top, with the needs of the homes alone when
    even they do not fit) and each short tier's need and budget (bytes, as `MemoryModel.needs`
    counts them)."""

    streaming: Streaming
    need_bytes: dict[Tier, int]
    budget_bytes: dict[Tier, int]


def ladder(piece_numel: int | None = None, prefetch_depth: int | None = None) -> list[Streaming]:
    """The settings in order of preference, the defaults first; a value given is the only one
    of its kind."""
    pieces = (
        [piece_numel]
        if piece_numel is not None
        else [
            PIECE_NUMEL >> i
            for i in range(PIECE_NUMEL.bit_length())
            if PIECE_NUMEL >> i >= SMALLEST_PIECE_NUMEL
        ]
    )
    depths = [prefetch_depth] if prefetch_depth is not None else list(DEPTHS)
    return sorted(
        (Streaming(p, d) for p in pieces for d in depths),
        key=lambda s: (
            s.piece_numel * FP32_NBYTES < MIN_REQUEST_BYTES,
            -s.piece_numel,
            -s.prefetch_depth,
        ),
    )


def choose_streaming(
    work: Workload,
    placement: Placement,
    budgets: dict[Tier, int | None],
    *,
    piece_numel: int | None = None,
    prefetch_depth: int | None = None,
    per_rank: bool = False,
) -> Streaming | Shortfall:
    """The setting `work` runs with at `placement` under `budgets` (bytes per tier; absent or
    None: unbounded), `piece_numel` / `prefetch_depth` fixed where given: the ladder's top if
    it fits, else its first rung that fits, else the `Shortfall`. `work`'s own piece size and
    depth are ignored. Needs compare as `MemoryModel.needs()` counts them: machine-wide host
    and nvme figures, or with `per_rank` one rank's share (the engine's budgets are per rank)."""
    rungs = ladder(piece_numel, prefetch_depth)
    bounded = {t: b for t, b in budgets.items() if b is not None}

    def over(needs: dict[Tier, int]) -> dict[Tier, int]:
        return {t: needs[t] for t, b in bounded.items() if needs[t] > b}

    def needs(s: Streaming) -> dict[Tier, int]:
        memory = peak_memory(streamed(work, s), placement)
        return (memory.per_rank() if per_rank else memory).needs()

    floor = homes_floor(work, placement)
    if per_rank:  # host and nvme floors are machine-wide, every rank's share alike
        floor = {t: n if t is Tier.GPU else n // work.world_size for t, n in floor.items()}
    if over(floor):  # the homes alone: no rung fits, none is evaluated
        return Shortfall(rungs[0], over(floor), {t: bounded[t] for t in over(floor)})
    top = needs(rungs[0])
    if not over(top):
        return rungs[0]
    if len(rungs) == 1:
        return Shortfall(rungs[0], over(top), {t: bounded[t] for t in over(top)})
    least = needs(rungs[-1])
    if over(least):
        return Shortfall(rungs[-1], over(least), {t: bounded[t] for t in over(least)})
    return next((s for s in rungs[1:-1] if not over(needs(s))), rungs[-1])


def streamed(work: Workload, streaming: Streaming) -> Workload:
    """`work` with `streaming`'s piece size and prefetch depth."""
    return dataclasses.replace(
        work, piece_numel=streaming.piece_numel, prefetch_depth=streaming.prefetch_depth
    )


def _binary(n: int) -> str:
    """`16 Mi`, `256 Ki`, `3072`: an element count as the ladder writes it."""
    for suffix, scale in (("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {suffix}"
    return str(n)
