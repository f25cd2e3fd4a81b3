"""`OpenParts`: what `Engine.open` builds over open tiers from the engine's parts, once.

The swap plans and their scheduler, the grad shards, the optimizer, the unit runner (installed
on the model's entry points) and the batch staging. Each is made from `EngineParts` alone, in
the order they need one another: the runner reads params through the scheduler and hands
grads to the grad shards; the optimizer tells the scheduler of each device param write.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierzero.engine.parts import EngineParts
from tierzero.engine.runtime.batch import BatchStaging
from tierzero.engine.runtime.execute import UnitRunner
from tierzero.engine.runtime.scheduler import Scheduler
from tierzero.engine.step.grads import GradShards
from tierzero.engine.step.optim import ShardOptimizer
from tierzero.layout.partition import forward_only
from tierzero.planning.swapplan import SwapPlan, swap_plans


@dataclass(frozen=True)
class OpenParts:
    """One open engine's runtime: built by `open_parts`, dropped with the engine."""

    scheduler: Scheduler
    grads: GradShards
    optimizer: ShardOptimizer
    runner: UnitRunner
    batches: BatchStaging  # pinned, reused across micro-batches
    train_plan: SwapPlan
    eval_plan: SwapPlan
    vertical_plan: SwapPlan


def open_parts(parts: EngineParts) -> OpenParts:
    """Build the runtime over `parts`' open tiers: grad homes allocated, the runner installed."""
    config, units = parts.config, parts.units
    scheduler = Scheduler(parts)
    grads = GradShards(parts)
    grads.allocate()
    optimizer = ShardOptimizer(parts, scheduler.written)
    runner = UnitRunner(units, scheduler.acquire, scheduler.release, grads.offload, parts.dtype,
                        forward_only(units), config.seed)
    runner.install()
    replicated = parts.comm.world_size == 1 or parts.stage <= 2  # nothing to gather
    plans = swap_plans(units, config.prefetch_depth, None if replicated else int(config.overlap_comm),
                       config.accumulate)
    return OpenParts(scheduler, grads, optimizer, runner, BatchStaging(parts.tiers.streams), *plans)
