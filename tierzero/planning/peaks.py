"""What the memory model answers: each tier's peak during a step, part by part.

Owns `TierPeak` (one tier's homes, its buffer pool's working set at the pool's busiest phase,
and torch's own allocations at theirs), `MemoryModel` (every tier's peak for one workload and
placement, host RAM as a whole, one rank's share, and the host pool's blocks), and the way
sizes are written in its breakdowns. How the parts are counted is
`tierzero.planning.memory_model`'s; these are the values it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierzero.config import Tier
from tierzero.planning.ledger import GB


@dataclass(frozen=True)
class TierPeak:
    """One tier at its busiest: its homes, its pool's working set at the pool's busiest phase
    (`pooled`), and the torch allocations at theirs (`unpooled`); bytes by part name."""

    tier: Tier
    homes_bytes: int
    pooled: dict[str, int]
    pooled_phase: str
    unpooled: dict[str, int]
    unpooled_phase: str

    @property
    def pool_bytes(self) -> int:
        """What the tier's buffer pool holds at its peak: the budget it needs."""
        return self.homes_bytes + sum(self.pooled.values())

    @property
    def unpooled_bytes(self) -> int:
        return sum(self.unpooled.values())

    @property
    def working_bytes(self) -> int:
        return self.peak_bytes - self.homes_bytes

    @property
    def peak_bytes(self) -> int:
        return self.pool_bytes + self.unpooled_bytes

    @property
    def parts(self) -> dict[str, int]:
        return {**self.pooled, **self.unpooled}

    def terms(self) -> list[str]:
        """`homes 10.00 GB`, then each working part with the phase where it peaks:
        `param staging 1.20 GB (backward)`."""
        terms = [f"homes {format_bytes(self.homes_bytes)}"]
        terms += [
            f"{name} {format_bytes(n)} ({self.pooled_phase})"
            for name, n in self.pooled.items()
            if n
        ]
        terms += [
            f"{name} {format_bytes(n)} ({self.unpooled_phase})"
            for name, n in self.unpooled.items()
            if n
        ]
        return terms

    def breakdown(self) -> str:
        """`host 12.35 GB = homes 10.00 GB + param staging 1.20 GB (backward) + ...`."""
        return f"{self.tier.value} {format_bytes(self.peak_bytes)} = {' + '.join(self.terms())}"

    def divided(self, n: int) -> TierPeak:
        """Every figure over `n` (one rank's share of a machine-wide peak)."""

        def share(parts: dict[str, int]) -> dict[str, int]:
            return {k: v // n for k, v in parts.items()}

        return TierPeak(
            self.tier,
            self.homes_bytes // n,
            share(self.pooled),
            self.pooled_phase,
            share(self.unpooled),
            self.unpooled_phase,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "homes_bytes": self.homes_bytes,
            "pool_bytes": self.pool_bytes,
            "pooled": dict(self.pooled),
            "pooled_phase": self.pooled_phase,
            "unpooled": dict(self.unpooled),
            "unpooled_phase": self.unpooled_phase,
        }


@dataclass(frozen=True)
class MemoryModel:
    """Every tier's peak for one workload and placement (`memory_model.peak_memory`).

    `host_memory` is host RAM as a whole: the host tier alone on a CUDA machine; on the CPU
    device the host tier, the gpu tier's pool and the compute allocations together.
    """

    device: str  # "cuda" | "cpu"
    world_size: int
    tiers: dict[Tier, TierPeak]
    host_memory: TierPeak
    host_cache_bytes: int  # what the LRU param cache would hold with budget to spare (nvme params)
    # one rank's host pool, class capacity -> blocks: its homes' and busiest moment's (every
    # class; they make up its pool_bytes), those other moments need beyond them, and the param
    # shards its LRU cache would hold (nvme params)
    host_blocks: dict[int, int] = field(default_factory=dict)
    host_moment_blocks: dict[int, int] = field(default_factory=dict)
    host_cache_blocks: dict[int, int] = field(default_factory=dict)

    def host_provision(self, budget_bytes: int) -> dict[int, int]:
        """The blocks one rank's host pool allocates (pins) at open under `budget_bytes`: its
        homes' and busiest moment's, then as many of those other moments need, then of the LRU
        cache's (which it would fill in the first step anyway), as the budget has room for."""
        blocks = dict(self.host_blocks)
        room = budget_bytes - self.per_rank().tiers[Tier.HOST].pool_bytes
        for extra in (self.host_moment_blocks, self.host_cache_blocks):
            for capacity, n in sorted(extra.items()):
                fit = max(0, min(n, room // capacity))
                blocks[capacity] = blocks.get(capacity, 0) + fit
                room -= fit * capacity
        return blocks

    @property
    def host_total_bytes(self) -> int:
        return self.host_memory.peak_bytes

    def needs(self) -> dict[Tier, int]:
        """Bytes each tier's budget must cover: the host's is all of host RAM's peak. On the CPU
        device that includes the gpu tier, which lives there too; its own budget then bounds
        only its pool (the compute allocations are host memory like the rest)."""
        gpu = self.tiers[Tier.GPU]
        return {
            Tier.GPU: gpu.pool_bytes if self.device == "cpu" else gpu.peak_bytes,
            Tier.HOST: self.host_total_bytes,
            Tier.NVME: self.tiers[Tier.NVME].peak_bytes,
        }

    def breakdown(self) -> list[str]:
        lines = [self.tiers[t].breakdown() for t in (Tier.GPU, Tier.HOST, Tier.NVME)]
        if self.device == "cpu":
            lines[0] += " (on the CPU device: host memory)"
            lines.append(
                f"host memory {format_bytes(self.host_total_bytes)} = host + gpu tiers, both in RAM"
            )
        return lines

    def per_rank(self) -> MemoryModel:
        """One rank's share: what its own pools and budgets must hold. Every host and nvme figure
        is `world_size` ranks' equal shares (gpu figures are one rank's already), so it divides
        exactly; one rank's model is itself."""
        w = self.world_size
        if w == 1:
            return self
        tiers = {
            **self.tiers,
            Tier.HOST: self.tiers[Tier.HOST].divided(w),
            Tier.NVME: self.tiers[Tier.NVME].divided(w),
        }
        return MemoryModel(
            self.device,
            1,
            tiers,
            self.host_memory.divided(w),
            self.host_cache_bytes // w,
            self.host_blocks,
            self.host_moment_blocks,
            self.host_cache_blocks,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "tiers": {t.value: p.as_dict() for t, p in self.tiers.items()},
            "host_total_bytes": self.host_total_bytes,
            "host_cache_bytes": self.host_cache_bytes,
        }


def tier_peak(
    tier: Tier, homes: int, phases: dict[str, dict[str, int]], pooled: frozenset[str]
) -> TierPeak:
    """The pooled parts at the phase where they are largest, and the rest at theirs."""

    def split(parts: dict[str, int], in_pool: bool) -> dict[str, int]:
        return {k: v for k, v in parts.items() if (k in pooled) == in_pool}

    pool_phase = max(phases, key=lambda p: sum(split(phases[p], True).values()))
    other_phase = max(phases, key=lambda p: sum(split(phases[p], False).values()))
    return TierPeak(
        tier,
        homes,
        split(phases[pool_phase], True),
        pool_phase,
        split(phases[other_phase], False),
        other_phase,
    )


def format_bytes(nbytes: int) -> str:
    """Decimal units, three significant figures or so: `1.12 TB`, `12.35 GB`, `48.2 MB`,
    `4.1 kB`."""
    for unit, scale in (("TB", 1000 * GB), ("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}" if scale >= GB else f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def format_count(n: float) -> str:
    """`6.74B`, `125.0M`, `3.21M`, `786.4k`: parameter counts at a glance."""
    for suffix, scale in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}" if suffix == "B" else f"{n / scale:.1f}{suffix}"
    return f"{n:.0f}"
