"""`OpenParts`: what `Engine.open` builds over the engine's parts once their tiers are open.

The swap plans and their swap runner, the grad shards, the optimizer, the unit runner (installed
on the model's entry points) and the batch staging. Each is made from the collaborators it
names (the rank's layout, the tiers, a config section), in the order they need one another: the
runner reads params through the swap runner and hands grads to the grad shards; the optimizer
tells the swap runner of each device param write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierzero.engine.parts import EngineParts
from tierzero.engine.runtime.batch import BatchStaging
from tierzero.engine.runtime.binding import place_buffers
from tierzero.engine.runtime.execute import UnitRunner
from tierzero.engine.runtime.swaprunner import SwapRunner
from tierzero.engine.step.gradnorms import GradNorms
from tierzero.engine.step.grads import GradShards
from tierzero.engine.step.optim import ShardOptimizer
from tierzero.layout.partition import forward_only
from tierzero.planning.swapplan import SwapPlan, swap_plans


@dataclass(frozen=True)
class OpenParts:
    """One open engine's runtime: built by `open_parts`, dropped with the engine."""

    swap_runner: SwapRunner
    grads: GradShards
    optimizer: ShardOptimizer
    runner: UnitRunner
    batches: BatchStaging  # pinned, reused across micro-batches
    train_plan: SwapPlan
    eval_plan: SwapPlan
    vertical_plan: SwapPlan


def open_parts(parts: EngineParts, fill: Callable[[], None]) -> OpenParts:
    """Open `parts`' tiers, `fill` them (`Shards.materialise`, or a checkpoint's restore) and
    build the runtime over them: grad homes allocated, the runner installed. Closes the tiers
    on failure."""
    if parts.device.type == "cuda":
        # The training thread's current device is the engine's, as it is on autograd's
        # thread for it: torch code that uses the current device (an optimizer's
        # `current_stream()`, `.cuda()`) then never creates a context on cuda:0.
        torch.cuda.set_device(parts.device)
    parts.tiers.open()
    try:
        place_buffers(parts.model, parts.device)
        fill()
        return _build(parts)
    except BaseException:
        parts.tiers.close()
        raise


def _build(parts: EngineParts) -> OpenParts:
    """Each part from the collaborators it names, in the order they need one another."""
    config, layout, tiers = parts.config, parts.layout, parts.tiers
    swap_runner = SwapRunner(layout, tiers, parts.shards)
    clips = config.optimizer.clip_grad_norm is not None
    fp16 = parts.counters.scaler.enabled
    norms = GradNorms(layout.comm, layout.piece_numel, tiers.device, clips, fp16)
    grads = GradShards(layout, tiers, norms, config.partitioning.overlap_comm)
    grads.allocate()
    optimizer = ShardOptimizer(
        layout,
        tiers,
        config.optimizer,
        parts.shards.formats,
        config.seed,
        config.streaming.prefetch_depth,
        swap_runner.written,
    )
    units = layout.units
    runner = UnitRunner(
        units,
        swap_runner.acquire,
        swap_runner.release,
        grads.offload,
        layout.dtype,
        parts.device,
        forward_only(units),
        config.seed,
    )
    runner.install()
    replicated = layout.comm.world_size == 1 or layout.stage <= 2  # nothing to gather
    plans = swap_plans(
        units,
        config.streaming.prefetch_depth,
        None if replicated else int(config.partitioning.overlap_comm),
        config.execution.accumulate,
    )
    return OpenParts(swap_runner, grads, optimizer, runner, BatchStaging(tiers.streams), *plans)
