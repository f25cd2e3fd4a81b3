"""CPU Adam over shards streamed through the tiers in pieces: read piece j+1, step j, write j-1.

Grads, master weights and both moments are stored per *piece*: a fixed-size slice of a unit's shard
(`Config.piece_numel` elements), so the optimizer's working set is a few pieces whatever the unit's
size -- a 128k-vocabulary embedding streams through the same buffers as a block. Per piece, a state
whose home is a memory tier on the stepping device is used in place (zero copy); any other is read
into a leased buffer, `prefetch_depth` pieces ahead. After torch's AdamW updates the piece
(elementwise, so stepping pieces is bitwise stepping the whole shard), off-device states are
written back and the new compute-dtype values go into the unit's param shard: in place where params
live in memory, else as the param piece of the same range. The stepping thread also casts the new
params (into the grad's buffer, which the step consumed, where it is a host one) and updates a
cached copy; the I/O loop then issues every write and gives the piece's buffers back once all have
finished (with overlap_step no cast, copy or write runs on autograd's thread). The step runs on the
compute device only when master and both moments live there. With overlap_step a piece's grad
reaches the host on the d2h stream (`tierzero.engine.runtime.streams`) and its AdamW, on the optimizer's
own thread (one OpenMP team, never the I/O workers'), waits for that copy's event. A host step
never copies to or from device memory synchronously: states and new params homed on the device move
on the d2h/h2d_write streams through pinned buffers, and the event of each param write goes to the
swap runner, whose next pass reads the params after it. A device step runs on the compute stream,
whichever thread issues it.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

import torch

from tierzero.adamw import adamw_step
from tierzero.config import OPTIMIZER_KINDS, Config, Placement, StateKind, Tier
from tierzero.engine.parts import EngineParts
from tierzero.engine.step.skipped import Run
from tierzero.engine.step.restep import KeptGeneration
from tierzero.layout.partition import Unit
from tierzero.engine.runtime.transfers import TransferStats
from tierzero.engine.runtime.streams import Event
from tierzero.engine.runtime.tiers import Tiers
from tierzero.layout.keys import piece_key, shard_key
from tierzero.planning.placement import Link
from tierzero.planning.workload import steps_on_gpu
from tierzero.storage.base import BudgetExceededError, TierStore

STEP_KINDS = (StateKind.GRAD, *OPTIMIZER_KINDS)  # what one piece's step reads
OPTIMIZER_LANE = "optimizer"  # the I/O loop's thread that runs every overlapped piece's step


@dataclass
class Work:
    """One piece of one unit's optimizer shards on the stepping device, and which are borrowed."""

    unit: Unit
    piece: int
    start: int  # the piece's range in the shard
    end: int
    runs: list[Run] = field(default_factory=list)  # the unit's runs to update (`SkippedSteps.runs`)
    tensors: dict[StateKind, torch.Tensor] = field(default_factory=dict)
    leased: dict[StateKind, torch.Tensor] = field(default_factory=dict)  # kind -> leased buffer
    futures: list = field(default_factory=list)
    grad_landed: Event = None  # the D2H copy of its grad piece (overlap_step), waited for by `Tiers.landed`
    produced: Event = None  # overlap_step: after it the grad is final, the params no more read in the pass
    copies: dict[StateKind, Event] = field(default_factory=dict)  # leased buffers read by h2d_write copies

    @property
    def numel(self) -> int:
        return self.end - self.start


class ShardOptimizer:
    def __init__(self, parts: EngineParts,
                 param_written: Callable[[int, Event], None] = lambda unit, event: None) -> None:
        tiers, placement = parts.tiers, parts.placement
        self.units, self.tiers, self.placement, self.config = parts.units, tiers, placement, parts.config
        self.compute_dtype, self.rank, self.stats = parts.dtype, parts.rank, parts.transfers
        self.param_written = param_written  # each device param write's event (`SwapRunner.written`)
        on_gpu = steps_on_gpu(placement)
        self.device = tiers.device if on_gpu else torch.device("cpu")
        if not on_gpu and tiers.device.type == "cuda":
            # the host step's threads: every core but the training thread's and the I/O loop's
            # (I/O workers sleep in pread/pwrite). Not on the CPU device, where the model's own
            # matmuls use these threads and their count may change how they sum.
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 2))
        self._prefetched: dict[tuple[int, int], Work] = {}
        self.kept: KeptGeneration | None = None  # set while overlapped steps keep their generation

    def works(self, unit: Unit, runs: list[Run] | None = None) -> list[Work]:
        """The unit's pieces, in order (nothing loaded yet); given `runs`, only the pieces that
        hold one (a piece whose parameters all got no gradient is neither read nor written)."""
        pieces = enumerate(unit.pieces(self.config.piece_numel, self.rank))
        if runs is None:
            return [Work(unit, i, a, b) for i, (a, b) in pieces]
        return [Work(unit, i, a, b, runs) for i, (a, b) in pieces if any(s < b and e > a for s, e, _, _ in runs)]

    def step(self, runs: dict[int, list[Run]], lr: float, grad_coef: float | None,
             kept: KeptGeneration | None = None) -> None:
        """One AdamW update of the `runs` of every unit's shard (`SkippedSteps.runs`, by unit
        index; a unit without runs is skipped), piece by piece; returns when every write has
        finished (the next pass reads what this one wrote). Given `kept`, steps each kept piece
        again from its kept generation instead (`tierzero.engine.step.restep`)."""
        depth = max(1, self.config.prefetch_depth)
        items = [Work(p.unit, p.piece, p.start, p.end, p.runs) for p in kept.pieces()] if kept else \
            [w for unit in self.units for w in self.works(unit, runs.get(unit.index, []))]
        loads: deque[Work] = deque()
        issued = 0
        for j in range(len(items)):
            while issued < min(len(items), j + depth):  # keep `depth` pieces loaded ahead
                if issued > j and not self._room_for(items[issued]):
                    break  # a tight budget: read ahead less rather than fail
                loads.append(self._load(items[issued], with_grad=kept is None, previous=kept is not None))
                issued += 1
            work = loads.popleft()
            self._wait(work)
            if kept is not None:
                kept.restore(work.unit.index, work.piece, work.tensors)
            self._reserve_staging(work)
            self._step(work, lr, grad_coef)
            self._write(work)
            self.tiers.pending.reap()
        self.tiers.pending.drain()

    def prefetch(self, unit: Unit) -> None:
        """Start reading `unit`'s first pieces of master and moments now (overlap_step: while
        backward computes); later pieces are read as earlier ones are stepped. A look-ahead on
        autograd's thread: with the pool short it stops rather than wait for a transfer."""
        for work in self.works(unit)[:max(1, self.config.prefetch_depth)]:
            if (unit.index, work.piece) not in self._prefetched:
                try:
                    self._prefetched[(unit.index, work.piece)] = self._load(work, wait=False)
                except BudgetExceededError:
                    return  # `step_unit` loads it

    def abort(self) -> None:
        """After an error mid-step: let prefetches land and return their buffers; release the
        generations an overlapped step kept for a re-step (else they stay on disk until reopened)."""
        for work in self._prefetched.values():
            self._discard(work)
        self._prefetched.clear()
        kept, self.kept = self.kept, None
        if kept is not None:
            kept.end()

    def _discard(self, work: Work) -> None:
        """Give back a piece's buffers without writing anything (its reads or step failed)."""
        for future in work.futures:
            future.exception()  # wait: an I/O thread may still be filling the buffer
        # and a grad piece on its way to the host (overlap_step) until its D2H copy has landed:
        # given back earlier, the late copy would overwrite the block's next holder
        self.tiers.streams.host_wait(work.grad_landed)
        for event in work.copies.values():  # and a buffer an h2d_write copy still reads
            self.tiers.streams.host_wait(event)
        for buf in work.leased.values():
            self._give_back(buf)

    def step_unit(self, unit: Unit, grad: torch.Tensor, runs: list[Run], lr: float,
                  grad_coef: float | None = None) -> None:
        """Step one unit as soon as its final grad shard exists (overlap_step), off the training
        thread: each piece's AdamW step runs on the optimizer's thread once its states land (torch
        releases the GIL, so backward continues meanwhile), then the I/O loop issues its writes.
        Loading a piece waits for buffers the pool does not have yet, so at most a budget's
        worth of pieces is in flight."""
        wanted = {w.piece for w in self.works(unit, runs)}
        produced = self.tiers.streams.record(self.tiers.streams.compute)  # the grad shard is final
        for work in self.works(unit):
            prefetched = self._prefetched.pop((unit.index, work.piece), None)
            if work.piece not in wanted:
                if prefetched is not None:
                    self._discard(prefetched)
                continue
            work = prefetched or self._load(work)
            work.runs = runs
            self._attach_grad(work, grad, produced)
            self._reserve_staging(work)
            self._count_writes(work)
            future = self.tiers.submit(self._step_when_loaded(work, lr, grad_coef))
            self.tiers.pending.add(future, lambda ok, w=work: self._settle(w) if ok else self._discard(w))

    async def _step_when_loaded(self, work: Work, lr: float, grad_coef: float | None) -> None:
        for future in work.futures:
            await asyncio.wrap_future(future)
        await self.tiers.landed(work.grad_landed)
        # on the optimizer's own thread (an I/O loop lane), never an I/O worker: one OpenMP team
        # steps the pieces one after another instead of one full team per worker, competing
        # with the chunk reads and writes; the new params' cast runs there too
        await self.tiers.io.wait_off_workers(self._step, work, lr, grad_coef, lane=OPTIMIZER_LANE)
        await self._write_back(work)

    def _attach_grad(self, work: Work, grad: torch.Tensor, produced: Event) -> None:
        """Use the piece's slice of the finished grad shard handed over by backward: in place on
        the stepping device, else copied on the d2h stream once compute has `produced` it."""
        part = grad[work.start:work.end]
        s = self.tiers.streams
        work.produced = produced
        if part.device == self.device and not (s.separate and self.device.type == "cpu"):
            work.tensors[StateKind.GRAD] = part
            return
        work.tensors[StateKind.GRAD] = work.leased[StateKind.GRAD] = self._lease(work.numel * 4).view(torch.float32)
        work.grad_landed = s.copy(work.leased[StateKind.GRAD], part, s.d2h, after=produced)
        s.keep_alive(part, s.d2h)
        self.stats.add_bytes(Link.GPU_TO_HOST, work.numel * 4)

    def _load(self, work: Work, with_grad: bool = False, wait: bool = True, previous: bool = False) -> Work:
        """Start bringing a piece's optimizer states (and its grad, if asked) to the stepping device;
        `previous` (a re-step): only nvme ones, as held (`NvmeStore.hold`). Every buffer is leased
        first, so `wait=False` (a look-ahead) short of buffers gives them back and raises."""
        unit = work.unit
        computed: Event = None  # one compute event serves every state of the piece
        kinds = STEP_KINDS if with_grad else OPTIMIZER_KINDS
        for kind in kinds:
            store = self.tiers.stores[self.placement.home(kind)]
            if store.capabilities.zero_copy:
                view = store.view(piece_key(kind, unit.index, self.rank, work.piece))
                if view.device == self.device:
                    work.tensors[kind] = view
                    continue
            try:
                work.tensors[kind] = work.leased[kind] = self._lease(work.numel * 4, wait).view(torch.float32)
            except BudgetExceededError:
                for buf in work.leased.values():
                    self._give_back(buf)
                raise
        for kind in kinds:
            home = self.placement.home(kind)
            if kind not in work.leased or (previous and home is not Tier.NVME):
                continue
            key = piece_key(kind, unit.index, self.rank, work.piece)
            store = self.tiers.stores[home]
            buf = work.leased[kind]
            if home is Tier.NVME:
                read = store.read_into(key, buf, previous=True) if previous else store.read_into(key, buf)
                work.futures.append(self.tiers.submit(read))
                self.stats.add_bytes(Link.NVME_TO_HOST, buf.numel() * 4)
            elif self._across(home):
                s = self.tiers.streams
                computed = computed or s.record(s.compute)
                work.futures.append(self.tiers.when_done(s.copy(buf, store.view(key), s.d2h, after=computed)))
                self.stats.add_bytes(Link.GPU_TO_HOST, buf.numel() * 4)
            else:
                buf.copy_(store.view(key))
                self.stats.add_bytes(Link.HOST_TO_GPU if self.device.type == "cuda" else Link.GPU_TO_HOST,
                                     buf.numel() * 4)
        return work

    def _lease(self, nbytes: int, wait: bool = True) -> torch.Tensor:
        """A working buffer on the stepping device (host pool for CPU steps)."""
        if self.device.type == "cpu":
            return self.tiers.lease_host(nbytes, wait)
        return self.tiers.lease_device(nbytes, wait)

    def _give_back(self, buf: torch.Tensor) -> None:
        pool = self.tiers.host_pool if buf.device.type == self.device.type == "cpu" else self.tiers.device_pool
        pool.give_back(buf.view(torch.uint8))

    def _wait(self, work: Work) -> None:
        with self.stats.waiting():
            for future in work.futures:
                future.result()
        work.futures.clear()

    def _across(self, home: Tier) -> bool:
        """Whether `home` is device memory while the step runs on the host: a transfer on the copy streams."""
        return home is Tier.GPU and self.device.type == "cpu" and self.tiers.streams.separate

    def _step(self, work: Work, lr: float, grad_coef: float | None) -> None:
        """AdamW on the piece, then its new params cast where they go (`_cast_param`), on the
        thread that steps it. On the device: on that thread's current stream (with overlap_step
        the optimizer thread's, not autograd's) after the grad's producer; what it read is marked
        used there (`keep_alive`), so the allocator never hands the grad out while it runs."""
        if self.device.type == "cpu":
            self._adamw(work, lr, grad_coef)
            self._cast_param(work)
            return
        s = self.tiers.streams
        with s.current(stream := s.compute):
            s.wait(stream, work.produced)
            self._adamw(work, lr, grad_coef)
            self._cast_param(work)
            for tensor in work.tensors.values():
                s.keep_alive(tensor, stream)

    def _adamw(self, work: Work, lr: float, grad_coef: float | None) -> None:
        t = work.tensors
        if self.kept is not None:  # exact clipping beside backward: what a re-step starts from
            self.kept.keep(work.unit, work.piece, work.start, work.end, work.runs, t)
        grad = t[StateKind.GRAD]
        if grad_coef is not None:  # clipping: the grad piece is consumed here, so scale in place
            grad.mul_(grad_coef)  # a host float: no device sync, and bitwise clip_grad_norm_'s fp32 product
        runs = [(max(a, work.start) - work.start, min(b, work.end) - work.start, d, step)
                for a, b, d, step in work.runs if min(b, work.end) > max(a, work.start)]
        adamw_step([t[StateKind.MASTER][a:b] for a, b, _, _ in runs],
                   [grad[a:b] for a, b, _, _ in runs],
                   [t[StateKind.EXP_AVG][a:b] for a, b, _, _ in runs],
                   [t[StateKind.EXP_AVG_SQ][a:b] for a, b, _, _ in runs],
                   [self.config.weight_decay if d else 0.0 for _, _, d, _ in runs],
                   [step for _, _, _, step in runs], lr, self.config)

    def _staged(self) -> bool:
        """Whether new params reach their home through host staging: on nvme, or in device
        memory from a host step."""
        home = self.placement.home(StateKind.PARAM)
        return home is Tier.NVME or self._across(home)

    def _reserve_staging(self, work: Work) -> None:
        """On the leasing thread, before the step: the host buffer the new params will be cast
        into. The grad's buffer serves where it is a host one (the step consumes the grad, and
        numel compute-dtype values fit in its fp32 bytes); only otherwise is one leased."""
        if not self._staged():
            return
        if StateKind.GRAD in work.leased and self.device.type == "cpu":
            work.leased[StateKind.PARAM] = work.leased.pop(StateKind.GRAD)
        else:
            work.leased[StateKind.PARAM] = self.tiers.lease_host(work.numel * self.compute_dtype.itemsize)

    def _staging(self, work: Work) -> torch.Tensor:
        nbytes = work.numel * self.compute_dtype.itemsize
        return work.leased[StateKind.PARAM].view(torch.uint8)[:nbytes].view(self.compute_dtype)

    def _param_home(self, work: Work) -> tuple[Tier, TierStore, str, int]:
        """The param home, its store, the unit's param shard key and this rank's offset in it
        (replicated params, stage 1/2: this rank's range of the whole unit; the other ranks'
        new values arrive after the step, `tierzero.engine.step.paramsync`)."""
        home = self.placement.home(StateKind.PARAM)
        key = shard_key(StateKind.PARAM, work.unit.index, self.rank)
        return home, self.tiers.stores[home], key, work.unit.param_offset(self.rank)

    def _cast_param(self, work: Work) -> None:
        """The new params in the compute dtype: straight into a param home in the same memory
        (on the device, on the compute stream, its event to the swap runner), else into the
        piece's staging, and into a cached copy of an nvme shard, so the next pass reads RAM,
        never stale values."""
        master = work.tensors[StateKind.MASTER]
        home, store, key, lo = self._param_home(work)
        if self._staged():
            self._staging(work).copy_(master)
            cached = self.tiers.host_pool.cache_get(key) if home is Tier.NVME else None
            if cached is not None:
                cached.view(self.compute_dtype)[lo + work.start:lo + work.end].copy_(self._staging(work))
                self.tiers.host_pool.give_back(cached)
            return
        dst = store.view(key)[lo + work.start:lo + work.end]
        if home is Tier.GPU and self.device.type != "cpu":
            s = self.tiers.streams
            self.param_written(work.unit.index, s.copy(dst, master, s.compute))  # cast in the copy
        else:
            dst.copy_(master)  # one memory: cast to the compute dtype in the copy

    def _write(self, work: Work) -> None:
        """From the training thread (`step`): count the piece's writes and hand them to the I/O loop."""
        self._count_writes(work)
        if work.produced is None and self._across(self.placement.home(StateKind.PARAM)):
            # what the param write waits for: compute as it is now, done with this pass's params
            work.produced = self.tiers.streams.record(self.tiers.streams.compute)
        future = self.tiers.submit(self._write_back(work))
        self.tiers.pending.add(future, lambda ok: self._settle(work) if ok else self._discard(work))

    def _count_writes(self, work: Work) -> None:
        """The bytes `_write_back` will move, counted on the training thread (the counters are its)."""
        for kind in OPTIMIZER_KINDS:
            if kind in work.leased:
                self._count(self.placement.home(kind), work.numel * 4)
        if self._staged():
            self._count(self.placement.home(StateKind.PARAM), work.numel * self.compute_dtype.itemsize)

    def _count(self, home: Tier, nbytes: int) -> None:
        if home is Tier.NVME:
            self.stats.add_bytes(Link.HOST_TO_NVME, nbytes)
        elif self._across(home):
            self.stats.add_bytes(Link.HOST_TO_GPU, nbytes)

    async def _write_back(self, work: Work) -> None:
        """On the I/O loop, after the step: write the leased states and the staged params to their
        homes at once, then give back every buffer no h2d_write copy reads (`_settle` hands
        those back once their copies land); after a failure, once every write has finished,
        the buffers stay for `_discard`."""
        grad = work.leased.pop(StateKind.GRAD, None)
        if grad is not None:
            self._give_back(grad)  # consumed by the step
        writes = [self._write_param(work) if kind is StateKind.PARAM else self._put(kind, work, buf)
                  for kind, buf in work.leased.items()]
        done = await asyncio.gather(*(w for w in writes if w is not None), return_exceptions=True)
        failed = [r for r in done if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        for kind in [k for k in work.leased if k not in work.copies]:
            self._give_back(work.leased.pop(kind))

    def _settle(self, work: Work) -> None:
        """On the training thread, once `_write_back` is done: the buffers h2d_write copies
        read go back to the pool when their copies have landed."""
        for kind, event in work.copies.items():
            self.tiers.give_back_when_done(event, work.leased.pop(kind))
        work.copies.clear()

    def _write_param(self, work: Work) -> Coroutine | None:
        """Start writing the staged params to their home: per piece on nvme (no buffer the size of
        a unit; the write to await), or on the h2d_write stream into device memory once compute
        has read the unit's params for the last time in the pass (`produced`), never a blocking
        copy; the next pass's reads wait for the copy's event (`param_written`)."""
        home, store, key, lo = self._param_home(work)
        staged = self._staging(work)
        if home is Tier.NVME:
            piece = work.unit.param_piece_base(self.config.piece_numel, self.rank) + work.piece
            return self._write_param_piece(store, piece_key(StateKind.PARAM, work.unit.index, self.rank, piece),
                                           staged, key)
        s = self.tiers.streams
        event = s.copy(store.view(key)[lo + work.start:lo + work.end], staged, s.h2d_write, after=work.produced)
        work.copies[StateKind.PARAM] = event
        self.param_written(work.unit.index, event)
        return None

    async def _write_param_piece(self, store: TierStore, piece: str, staged: torch.Tensor, key: str) -> None:
        try:
            await store.write(piece, staged)
        except BaseException:  # the drive does not hold these params: the cache must not serve them either
            self.tiers.host_pool.cache_drop(key)
            raise

    def _room_for(self, work: Work) -> bool:
        """Whether loading a piece ahead of time leaves the pool room for the piece being stepped."""
        pool = self.tiers.host_pool if self.device.type == "cpu" else self.tiers.device_pool
        states = self.leased_kinds() * work.numel * 4 + work.numel * self.compute_dtype.itemsize
        return 2 * states <= pool.budget_bytes - pool.leased_bytes

    def leased_kinds(self) -> int:
        """How many of grad/master/moments need a working buffer (not memory on the stepping device)."""
        def in_place(home: Tier) -> bool:
            store_device = self.tiers.device if home is Tier.GPU else torch.device("cpu")
            return home is not Tier.NVME and store_device.type == self.device.type
        return sum(1 for k in STEP_KINDS if not in_place(self.placement.home(k)))

    def _put(self, kind: StateKind, work: Work, buf: torch.Tensor) -> Coroutine | None:
        """Start writing a leased working buffer back to `kind`'s home: an nvme write to await,
        or an h2d_write copy whose event `work.copies` keeps."""
        home = self.placement.home(kind)
        store = self.tiers.stores[home]
        key = piece_key(kind, work.unit.index, self.rank, work.piece)
        if home is Tier.NVME:
            return store.write(key, buf)
        if self._across(home):  # nothing reads this state before the next step's load waits for it
            s = self.tiers.streams
            work.copies[kind] = s.copy(store.view(key), buf, s.h2d_write)
        else:
            store.view(key).copy_(buf)
        return None
