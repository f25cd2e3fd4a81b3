"""A pool budget too small for what the memory model counts: the one sentence that refuses it,
naming the tier as the user knows it, the figures, and the fixes left (`Sizing.check`)."""

from __future__ import annotations

import torch

from tierzero.config import StreamSettings, Tier
from tierzero.engine.runtime.tiers import Tiers
from tierzero.errors import ConfigError
from tierzero.planning.peaks import MemoryModel, format_bytes
from tierzero.planning.streaming import Streaming, ladder


def check_pools(
    tiers: Tiers, mem: MemoryModel, why: str, streaming: StreamSettings, given: list[str]
) -> None:
    """Refuse a pool whose budget (less what torch takes beside it) is below the memory model's
    figure, naming the tier as the user knows it (on the CPU device the host budget is all host
    memory), the piece size and prefetch depth it was counted at (resolved in `streaming`: the
    least tierzero chooses unless `given` or the batch is the reason), and the fixes left."""
    chosen = Streaming(streaming.piece_numel, streaming.prefetch_depth)
    least = not given and not why and chosen == ladder()[-1]
    budgets = {
        Tier.HOST: (tiers.host_budget, "--host-budget"),
        Tier.GPU: (tiers.gpu_budget, "--gpu-budget"),
    }
    for tier, (budget, flag) in budgets.items():
        need = mem.tiers[tier].pool_bytes
        if need > budget:
            total = tiers.total_budgets[tier]
            at = (
                f"even with {chosen.describe()}, the least tierzero chooses"
                if least
                else f"with {chosen.describe()}"
            )
            lower = (", use smaller batches" if why else "") + (
                f", lower {' or '.join(given)} (or leave it unset)" if given else ""
            )
            raise ConfigError(
                f"the {tier.value} budget of {total / 1e6:.1f} MB{_cpu_note(mem, tier)} is too "
                f"small: this model and placement{why} need at least "
                f"{(total - budget + need) / 1e6:.1f} MB "
                f"of {tier_name(tier, torch.device(mem.device))} {at} ({_breakdown(mem, tier)}); "
                f"raise {flag}{lower} or offload more state"
            )


def _cpu_note(mem: MemoryModel, tier: Tier) -> str:
    return (
        " (on the CPU device, the compute device's share of host memory)"
        if mem.device == "cpu" and tier is Tier.GPU
        else ""
    )


def tier_name(tier: Tier, device: torch.device) -> str:
    """A budget's tier as the user knows it: on the CPU device the host budget is all host
    memory."""
    return "host memory" if device.type == "cpu" and tier is Tier.HOST else f"{tier.value} memory"


def _breakdown(mem: MemoryModel, tier: Tier) -> str:
    if (
        tier is Tier.HOST and mem.device == "cpu"
    ):  # both pools and torch's allocations, each phase named once
        peak = mem.host_memory

        def parts(named: dict[str, int]) -> str:
            return " + ".join(f"{k} {format_bytes(n)}" for k, n in named.items() if n) or "nothing"

        return (
            f"host memory {format_bytes(peak.peak_bytes)} = homes "
            f"{format_bytes(peak.homes_bytes)} + pools ({peak.pooled_phase}) "
            f"{parts(peak.pooled)} + torch ({peak.unpooled_phase}) {parts(peak.unpooled)}"
        )
    peak = mem.host_memory if tier is Tier.HOST else mem.tiers[tier]
    return peak.breakdown()
