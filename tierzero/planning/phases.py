"""A training step's phases and the working set of each: what every tier holds beyond its homes.

Owns `StepShape` (one rank's per-unit sizes under a placement, read by every phase) and the
parts of each phase -- forward, backward, the optimizer (during backward with overlap_step),
and at stage 1/2 the param sync -- as {tier: {part: bytes}}; host parts as one rank's buffer
sizes, which `memory_model.peak_memory` rounds to the host pool's blocks and adds up.

What a part means, and which pool holds it (`memory_model.POOLED`; the others are torch
allocations):

- params in flight (device pool): param shards fetched ahead of compute, as the swap plan
  holds them (`schedule.build_swap_plan`, `prefetch_depth` uses ahead); none when params live
  on the compute device. With several ranks a call also gathers its units' full flat params,
  and with `overlap_comm` (and a fetch depth of at least 1) the next call's gather is in flight
  beside it. A coded base's shard lands coded in its decoded buffer's tail: the device holds
  the decoded values' bytes.
- param staging (host pool): nvme param shards read into host buffers on their way to the
  device (as stored: a coded base's pieces), from fetch until the copy is done (the wait on
  the CPU; the release on CUDA, whose copies are asynchronous). They stay in the pool as its
  LRU cache of param shards, which only takes spare budget (`host_cache_bytes`: what it would
  hold at most; never a need).
- unit grads: the per-parameter grads autograd writes (compute dtype) and the flat fp32 grad
  they are packed into once autograd is done with the recompute's activations, for the call
  being backpropagated (a tied head's call: both units); with overlap_step the previous
  call's grad shard too, until its pieces are stepped; with several ranks and `overlap_comm`
  the previous call's flat grad and reduced shard, whose reduce-scatter is still in flight.
  The backward's activations and unit grads are counted at the call and the moment where
  together they peak. With a grad dtype below fp32 the final shard is rounded in place, a
  piece's temporary at a time.
- grad staging (host pool): nvme grads on their way out, a piece per buffer, as many pieces
  in flight as the optimizer reads ahead (`prefetch_depth` + 1); the engine issues a whole
  unit's pieces at once, so spare budget lets more be in flight, never less than this.
- tied grad stash (a host buffer; the device pool with a device grad home): a tied
  embedding's first use's grad waits there until the second use's arrives, and is copied to
  the compute device for their sum (tied grad sum).
- optimizer pieces (the stepping device's pool): per piece of `piece_numel` elements, one
  buffer per state kind not on the stepping device, in its stored format: `prefetch_depth`
  pieces read ahead and one more whose writes are in flight when a state lives on nvme; with
  overlap_step, the first `prefetch_depth` pieces of the unit being stepped and of the next
  one, and the last piece of the one before. The engine issues a whole unit's pieces at once
  in backward, so spare budget lets more be in flight, never less than this.
- optimizer staging (host pool): a step on the device by choice (`Placement.optimizer`) reads
  each nvme-homed state's piece into a host buffer, copies it up, and copies it back there to
  be written: one per such state for each piece held as the optimizer pieces are.
- grad upcast (the stepping device's allocation): a stored grad piece below fp32 is stepped as
  its fp32 copy, one piece at a time (none in backward on the compute device: the fp32 shard is).
- new param staging (host pool): with params on nvme, or on the GPU with the step on the CPU,
  each stepped piece's new compute-dtype values are written from a host buffer of one piece
  (none where the param is the master: the master's write is the param's; but from a device
  step by choice, which copies them down into that buffer, one).
- activations (compute device): see `tierzero.planning.ledger.activation_memory`; a block
  that keeps its graph instead of being recomputed (`tierzero.planning.recompute`) adds its
  saved tensors (`recompute_bytes`) from its forward to its backward, so to both passes' peaks.
- param sync (stage 1/2): one unit at a time, its gathered values on the compute device and,
  with params on nvme, this rank's range staged in host memory.

Arithmetic on unit sizes: it allocates nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tierzero.compact.step import scratch_nbytes
from tierzero.config import OPTIMIZER_KINDS, Placement, StateKind, Tier
from tierzero.layout.partition import Unit, forward_only, forward_uses
from tierzero.planning.hostblocks import HOST_ALIGN, KeySizes, host_classes
from tierzero.planning.ledger import FP32_NBYTES, ActivationEstimate
from tierzero.planning.swapplan import Op, build_swap_plan
from tierzero.planning.workload import Workload, brings_up, steps_on_gpu
from tierzero.storage.sizeclass import class_for

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
PARAM_SYNC = "param sync"  # stage 1/2: each unit's new values all-gathered after the step
BACKWARD_AND_STEP = "backward+optimizer"  # overlap_step: units stepped as their grads arrive

Parts = dict[Tier, dict[str, Any]]  # gpu parts in bytes, host parts as one rank's buffer sizes


@dataclass(frozen=True)
class StepShape:
    """One rank's per-unit sizes under `placement`: what it stores (`keys`), the elements with
    weight grads (`trained`), the swap plan's calls, the host pool's size classes and every
    optimizer piece in stream order (`_stream`)."""

    work: Workload
    placement: Placement
    keys: KeySizes
    trained: list[int]
    calls: list[tuple[int, ...]]
    classes: tuple[int, ...]
    pieces: list[int]

    @classmethod
    def of(cls, work: Workload, placement: Placement) -> StepShape:
        units, c = work.units, work.compute_itemsize
        replicated = work.replicated
        shard = [u.padded_numel if replicated else u.shard_numel for u in units]
        state = [u.state_numel(0) for u in units]
        keys = KeySizes(
            shard,
            work.stored_param_nbytes(),
            state,
            work.piece_numel,
            c,
            work.formats,
            work.one_weight(placement),
            work.grad_itemsize,
            work.coded_pieces(),
        )
        sync = (  # stage 1/2 with nvme params: each rank's range staged for the param sync
            [u.shard_numel * c for u in units]
            if replicated and placement.param is Tier.NVME
            else []
        )
        tied = work.tied_embeddings
        classes = host_classes(placement, keys, tied, not steps_on_gpu(placement), sync)
        return cls(
            work,
            placement,
            keys,
            [min(u.numel, u.trainable_numel) for u in units],
            forward_uses(units),
            classes,
            _stream(state, work.piece_numel, max(1, work.prefetch_depth) + 1),
        )

    @property
    def state(self) -> list[int]:
        return self.keys.state

    @property
    def rounded(self) -> int:
        """A stored grad's bytes where below fp32's (the final shard is rounded first), else 0."""
        g = self.work.grad_itemsize
        return g if g < FP32_NBYTES else 0

    @property
    def step_device(self) -> str:
        return self.work.device if steps_on_gpu(self.placement) else "cpu"

    def blocks(self, sizes: Sequence[int]) -> int:
        """Host buffers of one rank at their classes' capacities."""
        return sum(class_for(n, self.classes, HOST_ALIGN) for n in sizes)

    def fp32_blocks(self, pieces: Sequence[int]) -> int:
        return self.blocks([p * FP32_NBYTES for p in pieces])


@dataclass(frozen=True)
class PassParams:
    """The pass's params, per phase (forward, backward): the peak bytes of shards on the device,
    the units in host staging at its peak, the most host blocks of each size staged at once;
    and the full params a call gathers (several ranks)."""

    flight: dict[str, int]
    staging: dict[str, list[int]]
    staged_blocks: dict[str, Counter[int]]
    gathered: int


def pass_params(shape: StepShape) -> PassParams:
    """Replay the swap plan's fetches, waits and releases for the pass's params."""
    work, units = shape.work, shape.work.units
    c, depth, w = work.compute_itemsize, work.prefetch_depth, work.world_size
    held = frozenset(u.index for u in units if u.is_root)
    plan = build_swap_plan(
        shape.calls, depth, backward=True, held=held, forward_only=forward_only(units)
    )
    flight, staging, most = _param_peaks(
        plan,
        [n * c for n in shape.keys.shard],
        shape.placement.param,
        staged_until_release=work.device == "cuda",
        staged_bytes=lambda u: shape.blocks([shape.keys.param_nbytes[u]]),
    )
    full = [sum(units[u].padded_numel for u in call) * c for call in shape.calls]
    if w == 1 or work.replicated:
        gathered = 0
    elif work.overlap_comm and depth > 0:  # a call's params and the next call's, gathered ahead
        order = full + full[::-1]  # the forward's calls, then backward's in reverse
        gathered = max(a + b for a, b in zip(order, order[1:] + [0]))
    else:
        gathered = max(full)
    return PassParams(flight, staging, most, gathered)


def forward(shape: StepShape, params: PassParams) -> Parts:
    act = shape.work.activations
    return {
        Tier.GPU: {
            "params in flight": params.flight[FORWARD],
            "gathered params": params.gathered,
            "activations": act.forward_bytes if act else 0,
        },
        Tier.HOST: {"param staging": [shape.keys.param_nbytes[u] for u in params.staging[FORWARD]]},
    }


def backward(shape: StepShape, params: PassParams, final_with_overlap: bool) -> Parts:
    """The call being backpropagated: while autograd runs, its recompute's activations and its
    weights' grads (compute dtype); then those grads and the flat fp32 grad they are packed into
    (and its reduce-scattered shard). With overlap the previous call's grad shard is still
    being stepped."""
    work, placement, state = shape.work, shape.placement, shape.state
    act, depth = work.activations, work.prefetch_depth
    recompute, grads = _backward_moment(shape, final_with_overlap)
    gpu = {
        "params in flight": params.flight[BACKWARD],
        "gathered params": params.gathered,
        "activations": (act.checkpoints_bytes + act.kept_bytes if act else 0) + recompute,
        "unit grads": grads,
    }
    host = {"param staging": [shape.keys.param_nbytes[u] for u in params.staging[BACKWARD]]}
    if placement.grad is Tier.NVME and not final_with_overlap:  # pieces written, read-ahead deep
        window = _window(shape.pieces, max(1, depth) + 1, shape.fp32_blocks)
        host["grad staging"] = [p * work.grad_itemsize for p in window]
    if work.tied_embeddings:  # the first use's grad waits in a host buffer (in the device pool
        # with a device grad home) and is copied to the compute device for the sum
        stash = state[0] * FP32_NBYTES
        host["tied grad stash"] = [stash] if placement.grad is not Tier.GPU else []
        gpu["tied grad stash"] = stash if placement.grad is Tier.GPU else 0
        gpu["tied grad sum"] = stash
    return {Tier.GPU: gpu, Tier.HOST: host}


def _backward_moment(shape: StepShape, final_with_overlap: bool) -> tuple[int, int]:
    """(recompute activations, unit grads) at the call and moment where their sum peaks."""
    work, state, calls = shape.work, shape.state, shape.calls
    units, c, w = work.units, work.compute_itemsize, work.world_size
    padded = [u.padded_numel for u in units]
    reducing = work.overlap_comm and w > 1  # the previous call's reduce-scatter ends a call later
    worst = (0, 0)
    for i, call in enumerate(calls):
        weights = sum(shape.trained[u] * c for u in call)
        flat = sum(
            (state[u] if w == 1 else padded[u] + state[u]) * FP32_NBYTES for u in call if state[u]
        )
        flat += max(min(work.piece_numel, state[u]) for u in call) * shape.rounded
        after = calls[i + 1] if final_with_overlap and i + 1 < len(calls) else ()
        # handed to the optimizer just before
        stepping = sum(state[u] * FP32_NBYTES for u in after)
        if reducing and i + 1 < len(calls):  # backpropagated just before: still being reduced
            stepping += sum((padded[u] + units[u].shard_numel) * FP32_NBYTES for u in calls[i + 1])
        recompute = _recompute_bytes(units[call[0]], work.activations)
        moment = (
            (recompute, weights + stepping) if recompute > flat else (0, weights + flat + stepping)
        )
        worst = max(worst, moment, key=sum)
    return worst


def optimizer(shape: StepShape, during_backward: bool) -> Parts:
    """The optimizer, piece by piece on its stepping device (during backward: as each unit's
    grad arrives)."""
    work, placement, formats = shape.work, shape.placement, shape.work.formats
    device, step_device = work.device, shape.step_device
    c, g = work.compute_itemsize, work.grad_itemsize
    # in backward the grad is handed over on the compute device: in place when it steps there
    up = brings_up(placement)
    grad_in_place = (
        device == step_device
        if during_backward
        else _in_place(placement.grad, device, step_device, up)
    )
    away = [k for k in OPTIMIZER_KINDS if not _in_place(placement.home(k), device, step_device, up)]
    away += [] if grad_in_place else [StateKind.GRAD]
    most = _optimizer_pieces(shape, during_backward)
    parts: Parts = {Tier.GPU: {}, Tier.HOST: {}}
    sized = [formats.nbytes(k, p, c, g) for k in away for p in most]  # per piece and state kind
    piece = min(work.piece_numel, max(shape.state))  # the largest piece stepped
    if steps_on_gpu(placement) or device == "cpu":  # allocated memory, outside the pools
        # (in backward on the compute device the fp32 shard itself is stepped: no upcast)
        upcast = 0 if during_backward and device == step_device else piece * FP32_NBYTES
        torch_parts = (
            ("compact scratch", scratch_nbytes(step_device) if formats.compact else 0),
            ("grad upcast", upcast if shape.rounded else 0),
        )
        parts[Tier.GPU].update({k: v for k, v in torch_parts if v})
    if steps_on_gpu(placement):
        parts[Tier.GPU]["optimizer pieces"] = sum(sized)
    else:
        parts[Tier.HOST]["optimizer pieces"] = sized
    if up:  # an nvme-homed state's piece passes through a host buffer on its way up and back
        on_drive = [k for k in away if placement.home(k) is Tier.NVME]
        parts[Tier.HOST]["optimizer staging"] = [
            formats.nbytes(k, p, c, g) for k in on_drive for p in most
        ]
        if placement.param is Tier.NVME:  # the new params, down from the device to the drive
            parts[Tier.HOST]["new param staging"] = [piece * c]
    if not work.one_weight(placement) and (
        placement.param is Tier.NVME or (placement.param is Tier.GPU and step_device != device)
    ):  # each stepped piece's new params, written (to nvme, or up to the device) from a host
        # buffer
        parts[Tier.HOST]["new param staging"] = [piece * c]
    return parts


def _optimizer_pieces(shape: StepShape, during_backward: bool) -> list[int]:
    """The pieces (elements) whose buffers are held at once at the optimizer's busiest."""
    work, placement, state = shape.work, shape.placement, shape.state
    ahead = max(1, work.prefetch_depth)
    if not during_backward:  # `ahead` pieces read, one more whose writes are in flight
        writing = any(  # writes that outlive their piece's step: to nvme, or to the other side
            placement.home(k) is Tier.NVME
            or (placement.home(k) is Tier.GPU and shape.step_device != work.device)
            or (placement.home(k) is Tier.HOST and brings_up(placement))
            for k in StateKind
            if k is not StateKind.GRAD
        )
        return _window(shape.pieces, ahead + (1 if writing else 0), shape.fp32_blocks)
    # unit u steps as u-1 computes: the first `ahead` pieces of both are read ahead, and the last
    # piece of u+1 (stepped before u) may still be in flight
    per_unit = [_stream([s], work.piece_numel, ahead) for s in state]
    last = [_stream([s], work.piece_numel, 1)[-1:] for s in state]
    return max(
        (
            [*per_unit[u][:ahead], *(per_unit[u - 1][:ahead] if u > 0 else [])]
            + (last[u + 1] if u + 1 < len(per_unit) else [])
            for u in range(len(per_unit))
        ),
        key=shape.fp32_blocks,
    )


def param_sync(shape: StepShape) -> Parts:
    """Stage 1/2: one unit at a time, its gathered values, and this rank's range read from nvme."""
    units, c = shape.work.units, shape.work.compute_itemsize
    largest = max(u.shard_numel for u in units)
    on_nvme = shape.placement.param is Tier.NVME
    return {
        Tier.GPU: {"gathered params": max(u.padded_numel for u in units) * c + largest * c},
        Tier.HOST: {
            "param staging": [largest * c] if on_nvme else [],
            "new param staging": [min(shape.work.piece_numel, largest) * c] if on_nvme else [],
        },
    }


def _recompute_bytes(unit: Unit, act: ActivationEstimate | None) -> int:
    """A unit's recompute and backward, beyond the checkpoints: the head's norm and one chunk
    of logits, a block's (or root's) saved tensors and temporaries; the embedding's nothing to
    speak of."""
    if act is None or unit.kind == "embedding":
        return 0
    return act.head_backward_bytes if unit.kind == "head" else act.block_backward_bytes


def _in_place(home: Tier, device: str, step_device: str, up: bool = False) -> bool:
    """Whether a state homed in `home` is used where it lies by a step on `step_device`; `up`: a
    step on the device by choice, which uses only device-homed states in place."""
    if home is Tier.NVME:
        return False
    if up:
        return home is Tier.GPU
    return (device if home is Tier.GPU else "cpu") == step_device


def _param_peaks(
    plan: Any,
    device_bytes: list[int],
    home: Tier,
    staged_until_release: bool,
    staged_bytes: Callable[[int], int],
) -> tuple[dict[str, int], dict[str, list[int]], dict[str, Counter[int]]]:
    """Per phase of the pass, replaying the swap plan's fetches, waits and releases: the peak
    bytes of param shards on the device (`device_bytes`: a unit's decoded buffer); the units in
    host staging at its peak (by `staged_bytes`, a unit's host block); and the most host blocks
    of each size staged at once."""
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
        if op.op is Op.FETCH:
            on_device[op.unit] = device_bytes[op.unit]
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
