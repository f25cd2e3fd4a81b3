"""The one memory model: every tier's peak bytes during a training step.

Owns the arithmetic of what each tier holds at its busiest: the state kinds homed there
(resident for the whole run) plus the working set of each phase of a step -- forward,
backward, and the optimizer (run during backward with overlap_step) -- made of the param
shards in flight, the gradients of the unit being backpropagated, the optimizer's pieces, the
activation checkpoints with one unit's recompute, one chunk of logits, and the host buffers
that stage all of it on its way to and from nvme. `tierzero plan` prints it; the engine sizes
and checks its budgets with it. Plans are data: this is arithmetic on unit sizes; it allocates
nothing and never probes the machine. What it returns (`TierPeak`, `MemoryModel`) is
`tierzero.planning.peaks`'s; what it is computed for, a `tierzero.planning.workload.Workload`.

Conventions (as in `tierzero.planning.placement`): gpu bytes are per rank, host and nvme bytes
per machine (every rank's shards and buffers). Stored grads take the grad dtype's bytes
(`Workload.grad_itemsize`: fp32, or the compute dtype where nothing is added to a stored grad,
`statebytes.grad_dtype`); master and Adam moments take their stored format's bytes
(`planning.statebytes`), a param that is the master none.
The homes are `planning.homes`'.
Frozen parameters have a param and nothing else: grads, master weights, Adam states and the
optimizer's pieces cover a unit's trainable prefix only (`Unit.trainable_numel`; with several ranks
counted at rank 0's share, the largest, for every rank).

How parts add up. A tier's buffer pool keeps what it has leased (idle buffers are reused, nvme
params stay cached) until its budget forces it to let go, so a pool's peak persists from its
busiest phase into every later one: a tier's peak is its homes, plus the pooled parts of the
phase where they are largest (what the pool's budget must cover, `pool_bytes`), plus the
other parts -- torch's own allocations, freed as they go -- of the phase where *they* are
largest. On the CPU device the gpu tier is host memory: `MemoryModel.host_memory` adds both
pools and the compute device's allocations; that is what `--host-budget` has to cover.

What each phase holds, part by part, is `tierzero.planning.phases`'.

ZeRO stage (several ranks; `stage`): at 3 a rank's param home holds its shard of each unit.
At 2 and 1 it holds whole units (replicated), so params in flight and the param cache are
whole units, nothing is gathered in the pass, and after the step each unit's new values are
all-gathered once (the `param sync` phase: the gathered unit on the compute device; with
params on nvme, this rank's range staged in host memory). At 1, with `accumulate` > 1, the
grad home also holds each unit's whole trainable gradient between micro-batches.

Host blocks. The host pool serves every lease from a few size classes (`HOST_CLASSES` at most,
`storage.sizeclass`), chosen here from every size the engine leases there, and allocates (pins)
at open the blocks of its homes and of its busiest moment (`MemoryModel.host_blocks`): each host
buffer above counts at its class's capacity, not its own bytes, and host homes count each key
at its class, so the pool's figure includes the rounding. Other moments of the step need blocks
of other classes (a block never serves another class's lease); with budget to spare the pool
pins those at open too (`host_moment_blocks`, `host_provision`), and without, it drops idle
blocks of one class to allocate another when they are needed (pinning in the step, counted).

Not counted: the process's fixed overhead (interpreter, torch, the I/O threads; README states
it), the allocator's slack, a model's buffers, the batch itself.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from tierzero.compact.step import scratch_nbytes
from tierzero.config import Placement, StateKind, Tier
from tierzero.planning.homes import home_bytes
from tierzero.planning.hostblocks import HOST_ALIGN, key_sizes
from tierzero.planning.ledger import FP32_NBYTES
from tierzero.planning.peaks import MemoryModel, TierPeak, tier_peak
from tierzero.planning.phases import (
    BACKWARD,
    BACKWARD_AND_STEP,
    FORWARD,
    OPTIMIZER,
    PARAM_SYNC,
    Parts,
    PassParams,
    StepShape,
    backward,
    forward,
    optimizer,
    param_sync,
    pass_params,
)
from tierzero.planning.workload import Workload, steps_on_gpu
from tierzero.storage.sizeclass import class_for

# the parts each tier's buffer pool holds (its budget covers these and the homes)
POOLED = {
    Tier.GPU: frozenset({"params in flight", "optimizer pieces", "tied grad stash"}),
    Tier.HOST: frozenset(
        {
            "param staging",
            "grad staging",
            "tied grad stash",
            "optimizer pieces",
            "optimizer staging",
            "new param staging",
        }
    ),
}


def peak_memory(work: Workload, placement: Placement) -> MemoryModel:
    """Every tier's peak working set (bytes) for one training step of `work` under `placement`.

    Each unit's padded layout, trainable prefix, kind and tied use are its `Unit`'s; the module
    docstring says how the parts add up, `tierzero.planning.phases` what each part is.
    """
    shape = StepShape.of(work, placement)
    w = work.world_size
    homes = home_bytes(work, placement, lambda kind: w * _counted_blocks(shape, kind))
    params = pass_params(shape)
    phases = _phases(shape, params)
    buffers = {name: parts[Tier.HOST] for name, parts in phases.items()}
    for parts in phases.values():  # host parts: one rank's buffers -> every rank's bytes
        parts[Tier.HOST] = {k: w * shape.blocks(v) for k, v in parts[Tier.HOST].items()}
    tiers = {
        t: tier_peak(t, homes[t], {name: parts[t] for name, parts in phases.items()}, POOLED[t])
        for t in (Tier.GPU, Tier.HOST)
    }
    tiers[Tier.NVME] = TierPeak(Tier.NVME, homes[Tier.NVME], {}, "every phase", {}, "every phase")
    host_blocks, moment_blocks = _host_blocks(shape, params, buffers, tiers[Tier.HOST])
    cached = (
        Counter(class_for(n, shape.classes, HOST_ALIGN) for n in shape.keys.param_nbytes)
        if placement.param is Tier.NVME
        else Counter()
    )
    return MemoryModel(
        work.device,
        w,
        tiers,
        _host_memory(shape, phases, tiers),
        w * sum(k * n for k, n in cached.items()),
        host_blocks,
        moment_blocks,
        dict(cached),
    )


def _counted_blocks(shape: StepShape, kind: StateKind) -> int:
    """One rank's host keys of `kind`, each at its class's capacity."""
    keys = key_sizes(kind, Tier.HOST, shape.keys)
    return sum(class_for(n, shape.classes, HOST_ALIGN) * k for n, k in keys.items())


def _phases(shape: StepShape, params: PassParams) -> dict[str, Parts]:
    """The step's phases in order, each tier's parts (host parts as one rank's buffers)."""
    work = shape.work
    phases = {FORWARD: forward(shape, params)}
    if not work.overlap or work.accumulate > 1:  # micro-batches whose grads are stored at home
        phases[BACKWARD] = backward(shape, params, final_with_overlap=False)
    if work.overlap:  # the last micro-batch: each unit is stepped as its grad arrives
        bwd = backward(shape, params, final_with_overlap=True)
        step = optimizer(shape, during_backward=True)
        phases[BACKWARD_AND_STEP] = {t: {**bwd[t], **step[t]} for t in (Tier.GPU, Tier.HOST)}
    else:
        phases[OPTIMIZER] = optimizer(shape, during_backward=False)
    if work.replicated:
        phases[PARAM_SYNC] = param_sync(shape)
    return phases


def _host_memory(
    shape: StepShape, phases: dict[str, Parts], tiers: dict[Tier, TierPeak]
) -> TierPeak:
    """Host RAM as a whole. On the CPU device: both pools, each at its own peak, and the compute
    allocations; on a GPU machine whose optimizer steps on the host, the host tier and the
    step's allocations outside its pool; else the host tier."""
    work, w = shape.work, shape.work.world_size
    host = tiers[Tier.HOST]
    if work.device == "cpu":
        gpu = tiers[Tier.GPU]
        unpooled = tier_peak(
            Tier.HOST,
            0,
            {
                name: {
                    **{k: v * w for k, v in parts[Tier.GPU].items()},
                    **{f"host {k}": v for k, v in parts[Tier.HOST].items()},
                }
                for name, parts in phases.items()
            },
            frozenset(POOLED[Tier.GPU] | {f"host {k}" for k in POOLED[Tier.HOST]}),
        )
        return TierPeak(
            Tier.HOST,
            host.homes_bytes + w * gpu.homes_bytes,
            {**{f"compute {k}": w * v for k, v in gpu.pooled.items()}, **host.pooled},
            f"compute pool at {gpu.pooled_phase}, host pool at {host.pooled_phase}",
            unpooled.unpooled,
            unpooled.unpooled_phase,
        )
    if steps_on_gpu(shape.placement):
        return host
    largest = min(work.piece_numel, max(shape.state))
    host_step = (
        ("compact scratch", scratch_nbytes("cpu") if work.formats.compact else 0),
        ("grad upcast", largest * FP32_NBYTES if shape.rounded else 0),
    )
    if not any(v for _, v in host_step):
        return host
    unpooled = {**host.unpooled, **{k: w * v for k, v in host_step if v}}
    return dataclasses.replace(host, unpooled=unpooled)


def _host_blocks(
    shape: StepShape,
    params: PassParams,
    buffers: dict[str, dict[str, Any]],
    host: TierPeak,
) -> tuple[dict[int, int], dict[int, int]]:
    """One rank's host pool blocks by class: its homes' keys and its busiest moment's buffers
    (what it pins at open), and those other moments need beyond them -- a block never serves
    another class's lease. In the pass, param staging is counted at every moment of the swap
    plan, not only at its peak."""
    classes, placement = shape.classes, shape.placement
    in_pass = {
        FORWARD: params.staged_blocks[FORWARD],
        BACKWARD: params.staged_blocks[BACKWARD],
        BACKWARD_AND_STEP: params.staged_blocks[BACKWARD],
    }
    in_phase = {
        name: Counter(
            class_for(n, classes, HOST_ALIGN)
            for part, bufs in parts.items()
            for n in bufs
            if part != "param staging" or name not in in_pass
        )
        | in_pass.get(name, Counter())
        for name, parts in buffers.items()
    }
    host_blocks = Counter(dict.fromkeys(classes, 0))
    for kind in StateKind:  # the homes' keys, each written into a block of the pool at open
        if placement.home(kind) is Tier.HOST:
            for n, k in key_sizes(kind, Tier.HOST, shape.keys).items():
                host_blocks[class_for(n, classes, HOST_ALIGN)] += k
    working = Counter(dict.fromkeys(classes, 0))
    for counts in in_phase.values():
        for k, n in counts.items():
            working[k] = max(working[k], n)
    at_peak = Counter(
        class_for(n, classes, HOST_ALIGN)
        for bufs in buffers[host.pooled_phase].values()
        for n in bufs
    )
    host_blocks.update(at_peak)
    return dict(host_blocks), dict(working - at_peak)
