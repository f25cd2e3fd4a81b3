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

Conventions (as in `tierzero.planning.placement`): gpu bytes are per rank, host and nvme bytes per machine
(every rank's shards and buffers). Stored grads take the grad dtype's bytes
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

What a part means, and which pool holds it (`POOLED`; the others are torch allocations):

- params in flight (device pool): param shards fetched ahead of compute, as the swap plan
  holds them (`schedule.build_swap_plan`, `prefetch_depth` uses ahead); none when params live
  on the compute device. With several ranks a call also gathers its units' full flat params,
  and with `overlap_comm` (and a fetch depth of at least 1) the next call's gather is in flight
  beside it.
- param staging (host pool): nvme param shards read into host buffers on their way to the
  device, from fetch until the copy is done (the wait on the CPU; the release on CUDA, whose
  copies are asynchronous). They stay in the pool as its LRU cache of param shards, which
  only takes spare budget (`host_cache_bytes`: what it would hold at most; never a need).
- unit grads: the per-parameter grads autograd writes (compute dtype) and the flat fp32 grad
  they are packed into once autograd is done with the recompute's activations, for the call
  being backpropagated (a tied head's call: both units); with overlap_step the previous
  call's grad shard too, until its pieces are stepped; with several ranks and `overlap_comm`
  the previous call's flat grad and reduced shard, whose reduce-scatter is still in flight. The backward's activations and unit
  grads are counted at the call and the moment where together they peak. With a grad dtype below
  fp32 the final shard is rounded in place, a piece's temporary at a time.
- grad staging (host pool): nvme grads on their way out, a piece per buffer, as many pieces
  in flight as the optimizer reads ahead (`prefetch_depth` + 1); the engine issues a whole
  unit's pieces at once, so spare budget lets more be in flight, never less than this.
- tied grad stash (a host buffer; the device pool with a device grad home): a tied
  embedding's first use's grad waits there until the second use's arrives, and is copied to
  the compute device for their sum (tied grad sum).
- optimizer pieces (the stepping device's pool): per piece of `piece_numel` elements, one
  buffer per state kind not on the stepping device, in its stored format: `prefetch_depth` pieces
  read ahead and one more whose writes are in flight when a state lives on nvme; with
  overlap_step, the first `prefetch_depth` pieces of the unit being stepped and of the next
  one, and the last piece of the one before. The engine issues a whole unit's pieces at once
  in backward, so spare budget lets more be in flight, never less than this.
- grad upcast (the stepping device's allocation): a stored grad piece below fp32 is stepped as
  its fp32 copy, one piece at a time (none in backward on the compute device: the fp32 shard is).
- new param staging (host pool): with params on nvme, or on the GPU with the step on the CPU,
  each stepped piece's new compute-dtype values are written from a host buffer of one piece
  (none where the param is the master: the master's write is the param's).
- activations (compute device): see `tierzero.planning.ledger.activation_memory`; a block
  that keeps its graph instead of being recomputed (`tierzero.planning.recompute`) adds its
  saved tensors (`recompute_bytes`) from its forward to its backward, so to both passes' peaks.

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
from collections.abc import Callable, Sequence
from typing import Any

from tierzero.compact.step import scratch_nbytes
from tierzero.config import OPTIMIZER_KINDS, Placement, StateKind, Tier
from tierzero.layout.partition import Unit, forward_only, forward_uses
from tierzero.planning.homes import home_bytes
from tierzero.planning.hostblocks import HOST_ALIGN, host_classes, key_sizes
from tierzero.planning.ledger import FP32_NBYTES, ActivationEstimate
from tierzero.planning.peaks import MemoryModel, TierPeak, tier_peak
from tierzero.planning.swapplan import Op, build_swap_plan
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
            "new param staging",
        }
    ),
}

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
PARAM_SYNC = "param sync"  # stage 1/2: each unit's new values all-gathered after the step
BACKWARD_AND_STEP = "backward+optimizer"  # overlap_step: units stepped as their grads arrive


def peak_memory(work: Workload, placement: Placement) -> MemoryModel:
    """Every tier's peak working set (bytes) for one training step of `work` under `placement`.

    Each unit's padded layout, trainable prefix, kind and tied use are its `Unit`'s; the module
    docstring says what each part is.
    """
    units, device = work.units, work.device
    w, c, depth, piece_numel = (
        work.world_size,
        work.compute_itemsize,
        work.prefetch_depth,
        work.piece_numel,
    )
    padded = [u.padded_numel for u in units]
    shard = [u.shard_numel for u in units]
    replicated = work.replicated
    stored_param = padded if replicated else shard  # what a rank's param home holds of each unit
    # the elements with grads and optimizer states: per rank (rank 0's, the largest), and
    # (compute dtype) weight grads
    state = [u.state_numel(0) for u in units]
    trained = [min(u.numel, u.trainable_numel) for u in units]
    calls = forward_uses(units)
    held = frozenset(u.index for u in units if u.is_root)
    tied = work.tied_embeddings
    g = work.grad_itemsize  # a stored grad's bytes (below fp32's: the final shard rounded first)
    rounded = g if g < FP32_NBYTES else 0

    step_on_gpu = steps_on_gpu(placement)
    sync = (
        [s * c for s in shard] if replicated and placement.param is Tier.NVME else []
    )  # param sync staging
    formats, one_weight = work.formats, work.one_weight(placement)
    classes = host_classes(
        placement,
        stored_param,
        state,
        piece_numel,
        c,
        tied=tied,
        step_on_host=not step_on_gpu,
        extra=sync,
        formats=formats,
        one_weight=one_weight,
        grad_itemsize=g,
    )

    def blocks(sizes: Sequence[int]) -> int:
        """Host buffers of one rank at their classes' capacities."""
        return sum(class_for(n, classes, HOST_ALIGN) for n in sizes)

    def counted_blocks(sizes: Counter[int]) -> int:
        """As `blocks`, of sizes counted (bytes -> how many)."""
        return sum(class_for(n, classes, HOST_ALIGN) * k for n, k in sizes.items())

    def fp32_blocks(pieces: Sequence[int]) -> int:
        return blocks([p * FP32_NBYTES for p in pieces])

    def host_keys(kind: StateKind) -> Counter[int]:
        return key_sizes(
            kind, stored_param, state, piece_numel, c, Tier.HOST, formats, one_weight, g
        )

    # a host home: a block per key
    homes = home_bytes(work, placement, lambda kind: w * counted_blocks(host_keys(kind)))

    # -- the pass: params in flight as the swap plan holds them
    plan = build_swap_plan(calls, depth, backward=True, held=held, forward_only=forward_only(units))
    flight, staging, staged_blocks = _param_peaks(
        plan,
        stored_param,
        c,
        placement.param,
        staged_until_release=device == "cuda",
        staged_bytes=lambda u: blocks([stored_param[u] * c]),
    )
    full = [sum(padded[u] for u in call) * c for call in calls]
    if w == 1 or replicated:
        gathered = 0
    elif work.overlap_comm and depth > 0:  # a call's params and the next call's, gathered ahead
        order = full + full[::-1]  # the forward's calls, then backward's in reverse
        gathered = max(a + b for a, b in zip(order, order[1:] + [0]))
    else:
        gathered = max(full)
    reducing = (
        work.overlap_comm and w > 1
    )  # the previous call's reduce-scatter finishes a call later
    act = work.activations
    # every piece in the order they stream, each unit's run of whole pieces cut to the longest
    # window asked for: the windows' contents are the same, and at small pieces there are millions
    pieces = _stream(state, piece_numel, max(1, depth) + 1)
    buffers: dict[str, dict[str, list[int]]] = {}  # phase -> host part -> one rank's buffer bytes

    def backward(final_with_overlap: bool) -> dict[Tier, dict[str, int]]:
        # the call being backpropagated: while autograd runs, its recompute's activations and its
        # weights' grads (compute dtype); then those grads and the flat fp32 grad they are packed
        # into (and its reduce-scattered shard). With overlap the previous call's grad shard is
        # still being stepped.
        worst = (0, 0)
        for i, call in enumerate(calls):
            weights = sum(trained[u] * c for u in call)
            flat = sum(
                (state[u] if w == 1 else padded[u] + state[u]) * FP32_NBYTES
                for u in call
                if state[u]
            )
            flat += max(min(piece_numel, state[u]) for u in call) * rounded
            after = calls[i + 1] if final_with_overlap and i + 1 < len(calls) else ()
            stepping = sum(
                state[u] * FP32_NBYTES for u in after
            )  # handed to the optimizer just before
            if reducing and i + 1 < len(calls):  # backpropagated just before: still being reduced
                stepping += sum((padded[u] + shard[u]) * FP32_NBYTES for u in calls[i + 1])
            recompute = _recompute_bytes(units[call[0]], act)
            moment = (
                (recompute, weights + stepping)
                if recompute > flat
                else (0, weights + flat + stepping)
            )
            worst = max(worst, moment, key=sum)
        gpu = {
            "params in flight": flight[BACKWARD],
            "gathered params": gathered,
            "activations": (act.checkpoints_bytes + act.kept_bytes if act else 0) + worst[0],
            "unit grads": worst[1],
        }
        host = {"param staging": [stored_param[u] * c for u in staging[BACKWARD]]}
        if (
            placement.grad is Tier.NVME and not final_with_overlap
        ):  # pieces written, read-ahead deep
            host["grad staging"] = [p * g for p in _window(pieces, max(1, depth) + 1, fp32_blocks)]
        if tied:  # the first use's grad waits in a host buffer (in the device pool with a device
            stash = (
                state[0] * FP32_NBYTES
            )  # grad home) and is copied to the compute device for the sum
            host["tied grad stash"] = [stash] if placement.grad is not Tier.GPU else []
            gpu["tied grad stash"] = stash if placement.grad is Tier.GPU else 0
            gpu["tied grad sum"] = stash
        return {Tier.GPU: gpu, Tier.HOST: host}

    # -- the optimizer, piece by piece on its stepping device
    step_tier = Tier.GPU if step_on_gpu else Tier.HOST
    step_device = device if step_on_gpu else "cpu"
    scratch = (
        scratch_nbytes(step_device) if formats.compact else 0
    )  # kept from the compact step's first use
    upcast = min(piece_numel, max(state)) * FP32_NBYTES if rounded else 0  # a piece, as stepped
    # writes that outlive their piece's step: to nvme, or from a host step up to the device (h2d)
    writing = any(
        placement.home(k) is Tier.NVME or (placement.home(k) is Tier.GPU and step_device != device)
        for k in StateKind
        if k is not StateKind.GRAD
    )

    def optimizer(during_backward: bool) -> dict[Tier, dict[str, int]]:
        # in backward the grad is handed over on the compute device: in place when it steps there
        grad_in_place = (
            device == step_device
            if during_backward
            else _in_place(placement.grad, device, step_device)
        )
        away = [k for k in OPTIMIZER_KINDS if not _in_place(placement.home(k), device, step_device)]
        away += [] if grad_in_place else [StateKind.GRAD]
        ahead = max(1, depth)
        if (
            during_backward
        ):  # unit u steps as u-1 computes: the first `ahead` pieces of both are read
            # ahead, and the last piece of u+1 (stepped before u) may still be in flight
            per_unit = [
                _stream([s], piece_numel, ahead) for s in state
            ]  # each unit's first `ahead` pieces
            last = [_stream([s], piece_numel, 1)[-1:] for s in state]
            most = max(
                (
                    [*per_unit[u][:ahead], *(per_unit[u - 1][:ahead] if u > 0 else [])]
                    + (last[u + 1] if u + 1 < len(per_unit) else [])
                    for u in range(len(per_unit))
                ),
                key=fp32_blocks,
            )
        else:  # `ahead` pieces read, one more whose writes are in flight
            most = _window(pieces, ahead + (1 if writing else 0), fp32_blocks)
        parts: dict[Tier, dict[str, list[int] | int]] = {Tier.GPU: {}, Tier.HOST: {}}
        # a buffer per piece and state kind, in its stored format
        sized = [formats.nbytes(k, p, c, g) for k in away for p in most]
        if step_tier is Tier.GPU or device == "cpu":  # allocated memory, outside the pools
            # (in backward on the compute device the fp32 shard itself is stepped: no upcast)
            grad_upcast = 0 if during_backward and device == step_device else upcast
            torch_parts = (("compact scratch", scratch), ("grad upcast", grad_upcast))
            parts[Tier.GPU].update({k: v for k, v in torch_parts if v})
        if step_tier is Tier.HOST:
            parts[Tier.HOST]["optimizer pieces"] = sized
        else:
            parts[Tier.GPU]["optimizer pieces"] = sum(sized)
        if not one_weight and (
            placement.param is Tier.NVME or (placement.param is Tier.GPU and step_device != device)
        ):
            # each stepped piece's new params, written (to nvme, or up to the device) from a host buffer
            parts[Tier.HOST]["new param staging"] = [min(piece_numel, max(state)) * c]
        return parts

    forward = {
        Tier.GPU: {
            "params in flight": flight[FORWARD],
            "gathered params": gathered,
            "activations": act.forward_bytes if act else 0,
        },
        Tier.HOST: {"param staging": [stored_param[u] * c for u in staging[FORWARD]]},
    }
    phases: dict[str, dict[Tier, dict[str, Any]]] = {FORWARD: forward}
    if (
        not work.overlap or work.accumulate > 1
    ):  # micro-batches whose grads are stored in their home
        phases[BACKWARD] = backward(final_with_overlap=False)
    if work.overlap:  # the last micro-batch: each unit is stepped as its grad arrives
        bwd, step = backward(final_with_overlap=True), optimizer(during_backward=True)
        phases[BACKWARD_AND_STEP] = {t: {**bwd[t], **step[t]} for t in (Tier.GPU, Tier.HOST)}
    else:
        phases[OPTIMIZER] = optimizer(during_backward=False)
    if replicated:  # one unit at a time: its gathered values, and this rank's range read from nvme
        phases[PARAM_SYNC] = {
            Tier.GPU: {"gathered params": max(padded) * c + max(shard) * c},
            Tier.HOST: {
                "param staging": [max(shard) * c] if placement.param is Tier.NVME else [],
                "new param staging": [min(piece_numel, max(shard)) * c]
                if placement.param is Tier.NVME
                else [],
            },
        }
    for name, parts in phases.items():  # host parts: one rank's buffers -> every rank's bytes
        buffers[name] = parts[Tier.HOST]
        parts[Tier.HOST] = {k: w * blocks(v) for k, v in parts[Tier.HOST].items()}

    tiers = {
        t: tier_peak(t, homes[t], {name: parts[t] for name, parts in phases.items()}, POOLED[t])
        for t in (Tier.GPU, Tier.HOST)
    }
    tiers[Tier.NVME] = TierPeak(Tier.NVME, homes[Tier.NVME], {}, "every phase", {}, "every phase")
    # with room, the host pool holds per class the blocks of the moment that needs most of that
    # class: a block never serves another class's lease
    # (in the pass, param staging at every moment of the swap plan, not only at its peak)
    in_pass = {
        FORWARD: staged_blocks[FORWARD],
        BACKWARD: staged_blocks[BACKWARD],
        BACKWARD_AND_STEP: staged_blocks[BACKWARD],
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
            for n, k in host_keys(kind).items():
                host_blocks[class_for(n, classes, HOST_ALIGN)] += k
    working = Counter(dict.fromkeys(classes, 0))
    for counts in in_phase.values():
        for k, n in counts.items():
            working[k] = max(working[k], n)
    at_peak = Counter(
        class_for(n, classes, HOST_ALIGN)
        for bufs in buffers[tiers[Tier.HOST].pooled_phase].values()
        for n in bufs
    )
    host_blocks.update(at_peak)
    host_memory = tiers[Tier.HOST]
    if device == "cpu":  # one RAM: both pools, each at its own peak, and the compute allocations
        gpu, host = tiers[Tier.GPU], tiers[Tier.HOST]
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
        host_memory = TierPeak(
            Tier.HOST,
            host.homes_bytes + w * gpu.homes_bytes,
            {**{f"compute {k}": w * v for k, v in gpu.pooled.items()}, **host.pooled},
            f"compute pool at {gpu.pooled_phase}, host pool at {host.pooled_phase}",
            unpooled.unpooled,
            unpooled.unpooled_phase,
        )
    elif (scratch or upcast) and step_tier is Tier.HOST:  # a GPU machine's host step: RAM outside
        # the host pool
        host_step = (("compact scratch", scratch), ("grad upcast", upcast))
        unpooled = {**host_memory.unpooled, **{k: w * v for k, v in host_step if v}}
        host_memory = dataclasses.replace(host_memory, unpooled=unpooled)
    cached = (
        Counter(class_for(n * c, classes, HOST_ALIGN) for n in stored_param)
        if placement.param is Tier.NVME
        else Counter()
    )
    cache = w * sum(k * n for k, n in cached.items())
    return MemoryModel(
        device,
        w,
        tiers,
        host_memory,
        cache,
        dict(host_blocks),
        dict(working - at_peak),
        dict(cached),
    )


def _recompute_bytes(unit: Unit, act: ActivationEstimate | None) -> int:
    """A unit's recompute and backward, beyond the checkpoints: the head's norm and one chunk
    of logits, a block's (or root's) saved tensors and temporaries; the embedding's nothing to
    speak of."""
    if act is None or unit.kind == "embedding":
        return 0
    return act.head_backward_bytes if unit.kind == "head" else act.block_backward_bytes


def _in_place(home: Tier, device: str, step_device: str) -> bool:
    """Whether a state homed in `home` is used where it lies by a step on `step_device`."""
    if home is Tier.NVME:
        return False
    return (device if home is Tier.GPU else "cpu") == step_device


def _param_peaks(
    plan: Any,
    shard: list[int],
    itemsize: int,
    home: Tier,
    staged_until_release: bool,
    staged_bytes: Callable[[int], int],
) -> tuple[dict[str, int], dict[str, list[int]], dict[str, Counter[int]]]:
    """Per phase of the pass, replaying the swap plan's fetches, waits and releases: the peak
    bytes of param shards on the device; the units in host staging at its peak (by
    `staged_bytes`, a unit's host block); and the most host blocks of each size staged at once."""
    flight = {FORWARD: 0, BACKWARD: 0}
    staging: dict[str, list[int]] = {FORWARD: [], BACKWARD: []}
    most: dict[str, Counter[int]] = {FORWARD: Counter(), BACKWARD: Counter()}
    if home is Tier.GPU:  # resident in the device store: views, nothing in flight
        return flight, staging, most
    on_device: dict[int, int] = {}
    staged: dict[int, int] = {}
    phase = FORWARD
    for op in plan.ops:
        if op.op in (Op.WAIT, Op.COMPUTE):
            phase = op.phase
        nbytes = shard[op.unit] * itemsize
        if op.op is Op.FETCH:
            on_device[op.unit] = nbytes
            if home is Tier.NVME:
                staged[op.unit] = staged_bytes(op.unit)
        elif op.op is Op.WAIT and not staged_until_release:
            staged.pop(op.unit, None)
        elif op.op is Op.RELEASE:
            on_device.pop(op.unit, None)
            staged.pop(op.unit, None)
        flight[phase] = max(flight[phase], sum(on_device.values()))
        if sum(staged.values()) > sum(staged_bytes(u) for u in staging[phase]):
            staging[phase] = list(staged)
        most[phase] |= Counter(staged.values())
    return flight, staging, most


def _stream(state: list[int], piece_numel: int, most: int) -> list[int]:
    """The pieces (elements) of every unit's `state` numel in stream order, as `piece_ranges` cuts
    them, with each unit's whole pieces cut to `most`: any `most` consecutive pieces of the
    real stream are some `most` consecutive ones of this, and the other way round."""
    stream: list[int] = []
    for s in state:
        whole, rest = divmod(s, piece_numel)
        stream += [piece_numel] * min(whole, most) + ([rest] if rest else [])
    return stream


def _window(pieces: list[int], n: int, nbytes: Callable[[Sequence[int]], int]) -> list[int]:
    """The `n` consecutive pieces (the engine streams them in unit order) whose buffers take
    the most bytes (`nbytes`)."""
    return max((pieces[j : j + n] for j in range(len(pieces))), key=nbytes, default=[])
