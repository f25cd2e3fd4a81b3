"""CPU Adam over shards streamed through the tiers in pieces: read piece j+1, step j, write j-1.

Grads, master weights and both moments are stored per *piece*: a fixed-size slice of a unit's shard
(`Config.piece_numel` elements), so the optimizer's working set is a few pieces whatever the unit's
size -- a 128k-vocabulary embedding streams through the same buffers as a block. Per piece, a state
whose home is a memory tier on the stepping device is used in place (zero copy); any other is read
into a leased buffer, `prefetch_depth` pieces ahead, in its stored format
(`tierzero.compact.formats`). After torch's AdamW updates the piece (elementwise, so stepping pieces
is bitwise stepping the whole shard; compact master or moments: `tierzero.compact.step`), off-device
states are written back and the new compute-dtype values go into the unit's param shard: in place
where params live in memory, else as the param piece of the same range
(`tierzero.engine.step.writeback`: with overlap_step no cast, copy or write runs on autograd's
thread). The step runs on the compute device only when master and both moments live there. With
overlap_step a piece's grad reaches the host on the d2h stream (`tierzero.engine.runtime.streams`)
and its AdamW, on the optimizer's own thread (one OpenMP team, never the I/O workers'), waits for
that copy's event. A host step never copies to or from device memory synchronously: states and new
params homed on the device move on the d2h/h2d_write streams through pinned buffers, and the event
of each param write goes to the scheduler, whose next pass reads the params after it. A device step
runs on the compute stream, whichever thread issues it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Callable

import torch

from tierzero.adamw import adamw_step
from tierzero.compact.formats import StateFormats
from tierzero.compact.step import CompactStep
from tierzero.config import OPTIMIZER_KINDS, OptimizerSettings, StateKind, Tier
from tierzero.engine.runtime.busy import OPTIMIZER
from tierzero.engine.runtime.layout import RankLayout
from tierzero.engine.runtime.streams import Event
from tierzero.engine.runtime.tiers import Tiers
from tierzero.engine.step.restep import KeptGeneration
from tierzero.engine.step.roundtrip import RoundTrip
from tierzero.engine.step.skipped import Run
from tierzero.engine.step.work import Work
from tierzero.engine.step.writeback import PieceWrites
from tierzero.layout.keys import piece_key
from tierzero.layout.partition import Unit
from tierzero.planning.placement import Link
from tierzero.planning.workload import brings_up, steps_on_gpu
from tierzero.storage.base import BudgetExceededError, TierStore

STEP_KINDS = (StateKind.GRAD, *OPTIMIZER_KINDS)  # what one piece's step reads


class ShardOptimizer(PieceWrites, RoundTrip):
    def __init__(
        self,
        layout: RankLayout,
        tiers: Tiers,
        settings: OptimizerSettings,
        formats: StateFormats,
        seed: int,
        prefetch_depth: int,
        param_written: Callable[[int, Event], None] = lambda unit, event: None,
    ) -> None:
        """`formats`: how master, moments and grads are stored (bf16 grads are upcast);
        `seed`: the compact step's rounding draws; `prefetch_depth`: pieces read ahead;
        `param_written`: each device param write's event (`SwapRunner.written`)."""
        placement, compute_dtype = layout.placement, layout.dtype
        self.units, self.tiers, self.placement, self.settings = (
            layout.units,
            tiers,
            placement,
            settings,
        )
        self.compute_dtype, self.rank, self.stats = compute_dtype, layout.rank, tiers.stats
        self.piece_numel, self.prefetch_depth = layout.piece_numel, prefetch_depth
        self.param_written = param_written
        on_gpu = steps_on_gpu(placement)
        self.device = tiers.device if on_gpu else torch.device("cpu")
        # stepped on the device by choice: states not homed there come up and go back
        self.up = brings_up(placement)
        self.formats = formats
        self.master_is_param = self.formats.master_is_param(compute_dtype)
        if self.master_is_param:  # the master is read where the params live (`_source`)
            self.placement = dataclasses.replace(placement, master=placement.param)
        # its scratch is allocated at its first step
        self.compact = CompactStep(formats, settings, seed, self.device)
        self._prefetched: dict[tuple[int, int], Work] = {}
        self.kept: KeptGeneration | None = None  # set while overlapped steps keep their generation

    def works(self, unit: Unit, runs: list[Run] | None = None) -> list[Work]:
        """The unit's pieces, in order (nothing loaded yet); given `runs`, only the pieces that
        hold one (a piece whose parameters all got no gradient is neither read nor written)."""
        pieces = enumerate(unit.pieces(self.piece_numel, self.rank))
        if runs is None:
            return [Work(unit, i, a, b) for i, (a, b) in pieces]
        return [
            Work(unit, i, a, b, runs)
            for i, (a, b) in pieces
            if any(s < b and e > a for s, e, _, _ in runs)
        ]

    def step(
        self,
        runs: dict[int, list[Run]],
        lr: float,
        grad_coef: float | None,
        kept: KeptGeneration | None = None,
    ) -> None:
        """One AdamW update of the `runs` of every unit's shard (`SkippedSteps.runs`, by unit
        index; a unit without runs is skipped), piece by piece; returns when every write has
        finished (the next pass reads what this one wrote). Given `kept`, steps each kept piece
        again from its kept generation instead (`tierzero.engine.step.restep`)."""
        depth = max(1, self.prefetch_depth)
        items = (
            [Work(p.unit, p.piece, p.start, p.end, p.runs) for p in kept.pieces()]
            if kept
            else [w for unit in self.units for w in self.works(unit, runs.get(unit.index, []))]
        )
        loads: deque[Work] = deque()
        issued = 0
        for j in range(len(items)):
            while issued < min(len(items), j + depth):  # keep `depth` pieces loaded ahead
                if issued > j and not self._room_for(items[issued]):
                    break  # a tight budget: read ahead less rather than fail
                loads.append(
                    self._load(items[issued], with_grad=kept is None, previous=kept is not None)
                )
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
        for work in self.works(unit)[: max(1, self.prefetch_depth)]:
            if (unit.index, work.piece) not in self._prefetched:
                try:
                    self._prefetched[(unit.index, work.piece)] = self._load(work, wait=False)
                except BudgetExceededError:
                    return  # `step_unit` loads it

    def abort(self) -> None:
        """After an error mid-step: let prefetches land and return their buffers; release the
        generations an overlapped step kept for a re-step (else they stay on disk until
        reopened)."""
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
        self._give_back_all(work)

    def step_unit(
        self,
        unit: Unit,
        grad: torch.Tensor,
        runs: list[Run],
        lr: float,
        grad_coef: float | None = None,
    ) -> None:
        """Step one unit as soon as its final grad shard exists (overlap_step), off the training
        thread: each piece's AdamW step runs on the optimizer's thread once its states land (torch
        releases the GIL, so backward continues meanwhile), then the I/O loop issues its writes.
        Loading a piece waits for buffers the pool does not have yet, so at most a budget's
        worth of pieces is in flight; that wait stalls backward and is counted apart
        (`wait_optimizer_s`)."""
        wanted = {w.piece for w in self.works(unit, runs)}
        produced = self.tiers.streams.record(self.tiers.streams.compute)  # the grad shard is final
        for work in self.works(unit):
            prefetched = self._prefetched.pop((unit.index, work.piece), None)
            if work.piece not in wanted:
                if prefetched is not None:
                    self._discard(prefetched)
                continue
            if prefetched is not None:
                work = prefetched
            else:
                with self.stats.backpressure():  # waits only while the pool has no buffer free
                    work = self._load(work)
            work.runs = runs
            self._attach_grad(work, grad, produced)
            self._reserve_staging(work)
            self._count_writes(work)
            future = self.tiers.submit(self._step_when_loaded(work, lr, grad_coef))
            self.tiers.pending.add(
                future, lambda ok, w=work: self._settle(w) if ok else self._discard(w)
            )

    async def _step_when_loaded(self, work: Work, lr: float, grad_coef: float | None) -> None:
        for future in work.futures:
            await asyncio.wrap_future(future)
        await self.tiers.landed(work.grad_landed)
        # on the I/O loop's host-math thread, never an I/O worker: one OpenMP team steps the
        # pieces one after another instead of one full team per worker, competing with the
        # chunk reads and writes; the new params' cast runs there too
        await self.tiers.io.run_math(self._step, work, lr, grad_coef)
        await self._write_back(work)

    def _attach_grad(self, work: Work, grad: torch.Tensor, produced: Event) -> None:
        """Use the piece's slice of the finished grad shard handed over by backward: in place on
        the stepping device, else copied on the d2h stream once compute has `produced` it, in
        the grad dtype (cast in the copy, exact: backward rounded the shard to it)."""
        part = grad[work.start : work.end]
        s = self.tiers.streams
        work.produced = produced
        if self.up or (
            part.device == self.device and not (s.separate and self.device.type == "cpu")
        ):
            work.tensors[StateKind.GRAD] = part  # made where the step runs
            return
        raw = self._lease(self.formats.nbytes(StateKind.GRAD, work.numel))
        leased = self.formats.view(StateKind.GRAD, raw, work.numel)
        work.tensors[StateKind.GRAD] = work.leased[StateKind.GRAD] = leased
        work.grad_landed = s.copy(work.leased[StateKind.GRAD], part, s.d2h, after=produced)
        s.keep_alive(part, s.d2h)
        self.stats.add_bytes(Link.GPU_TO_HOST, work.leased[StateKind.GRAD].nbytes)

    def _load(
        self, work: Work, with_grad: bool = False, wait: bool = True, previous: bool = False
    ) -> Work:
        """Start bringing a piece's optimizer states (and its grad, if asked) to the stepping
        device; `previous` (a re-step): only nvme ones, as held (`NvmeStore.hold`). Every buffer is
        leased first, so `wait=False` (a look-ahead) short of buffers gives them back and raises."""
        computed: Event = None  # one compute event serves every state of the piece
        kinds = STEP_KINDS if with_grad else OPTIMIZER_KINDS
        for kind in kinds:
            home = self.placement.home(kind)
            store = self.tiers.stores[home]
            if self.up and home is Tier.GPU:
                work.tensors[kind] = self._source(kind, work, store)
                continue
            if store.capabilities.zero_copy and not self.up:
                view = self._source(kind, work, store)
                if view.device == self.device:
                    work.tensors[kind] = view
                    continue
            nbytes = self.formats.nbytes(kind, work.numel)
            try:
                raw = self._lease(nbytes, wait)
                work.tensors[kind] = work.leased[kind] = self.formats.view(kind, raw, work.numel)
                if self.up and home is Tier.NVME:  # read into the host, then copied up
                    raw = self.tiers.lease_host(nbytes, wait)
                    work.staging[kind] = self.formats.view(kind, raw, work.numel)
            except BudgetExceededError:
                self._give_back_all(work)
                raise
        for kind in kinds:
            home = self.placement.home(kind)
            if kind not in work.leased or (previous and home is not Tier.NVME):
                continue
            store = self.tiers.stores[home]
            buf = work.leased[kind]
            if self.up:
                work.futures.append(self._bring_up(kind, work, buf, previous))
            elif home is Tier.NVME:
                key = self._source(kind, work)
                read = (
                    store.read_into(key, buf, previous=True)
                    if previous
                    else store.read_into(key, buf)
                )
                work.futures.append(self.tiers.submit(read))
                self.stats.add_bytes(Link.NVME_TO_HOST, buf.nbytes)
            elif self._across(home):
                s = self.tiers.streams
                computed = computed or s.record(s.compute)
                work.futures.append(
                    self.tiers.when_done(
                        s.copy(buf, self._source(kind, work, store), s.d2h, after=computed)
                    )
                )
                self.stats.add_bytes(Link.GPU_TO_HOST, buf.nbytes)
            else:
                buf.copy_(self._source(kind, work, store))
                self.stats.add_bytes(
                    Link.HOST_TO_GPU if self.device.type == "cuda" else Link.GPU_TO_HOST, buf.nbytes
                )
        return work

    def _source(
        self, kind: StateKind, work: Work, store: TierStore | None = None
    ) -> str | torch.Tensor:
        """A piece's key in its home (given the home's memory `store`: the tensor viewed there).
        A master that is the param (`StateFormats.master_is_param`) is the param's piece on nvme,
        and its range of the param shard in memory."""
        if kind is StateKind.MASTER and self.master_is_param:
            home, _, key, lo = self._param_home(work)
            if home is Tier.NVME:
                piece = work.unit.param_piece_base(self.piece_numel, self.rank) + work.piece
                key = piece_key(StateKind.PARAM, work.unit.index, self.rank, piece)
            elif store is not None:
                return store.view(key)[lo + work.start : lo + work.end]
        else:
            key = piece_key(kind, work.unit.index, self.rank, work.piece)
        return key if store is None else store.view(key)

    def _lease(self, nbytes: int, wait: bool = True) -> torch.Tensor:
        """A working buffer on the stepping device (host pool for CPU steps)."""
        if self.device.type == "cpu" and not self.up:
            return self.tiers.lease_host(nbytes, wait)
        return self.tiers.lease_device(nbytes, wait)

    def _wait(self, work: Work) -> None:
        with self.stats.waiting():
            for future in work.futures:
                future.result()
        work.futures.clear()

    def _step(self, work: Work, lr: float, grad_coef: float | None) -> None:
        """AdamW on the piece, then its new params cast where they go (`_cast_param`), on the
        thread that steps it. On the device: on that thread's current stream (with overlap_step
        the optimizer thread's, not autograd's) after the grad's producer; what it read is marked
        used there (`keep_alive`), so the allocator never hands the grad out while it runs."""
        if self.device.type == "cpu" and not self.up:
            with self.stats.busy.timed(OPTIMIZER):  # compute only: its states have landed
                self._adamw(work, lr, grad_coef)
                self._cast_param(work)
            return
        s = self.tiers.streams
        with s.current(stream := s.compute):
            s.wait(stream, work.produced)
            with s.timed(OPTIMIZER, stream):  # after the wait: compute only
                self._adamw(work, lr, grad_coef)
                self._cast_param(work)
                if self.up:  # what the copies down, and the buffers' next holders, wait for
                    work.stepped = s.record(stream)
            for tensor in work.tensors.values():
                s.keep_alive(tensor, stream)

    def _adamw(self, work: Work, lr: float, grad_coef: float | None) -> None:
        t = work.tensors
        if self.kept is not None:  # exact clipping beside backward: what a re-step starts from
            self.kept.keep(work.unit, work.piece, work.start, work.end, work.runs, t)
        grad = t[StateKind.GRAD]
        # a bf16 grad piece: its exact fp32 value is what AdamW steps. The compact step decodes
        # it itself, a chunk at a time (no fp32 copy of the piece: a pass over 6 bytes a value
        # less), unless clipping scales it first
        if grad.dtype != torch.float32 and (self.formats.exact or grad_coef is not None):
            grad = t[StateKind.GRAD] = grad.float()
        if grad_coef is not None:  # clipping: the grad piece is consumed here, so scale in place
            grad.mul_(
                grad_coef
            )  # a host float: no device sync, and bitwise clip_grad_norm_'s fp32 product
        runs = [
            (max(a, work.start) - work.start, min(b, work.end) - work.start, d, step)
            for a, b, d, step in work.runs
            if min(b, work.end) > max(a, work.start)
        ]
        if not self.formats.exact:  # compact master or moments: stepped in fp32 sub-blocks
            spans = [
                (a, b, self.settings.weight_decay if d else 0.0, step) for a, b, d, step in runs
            ]
            origin = (
                work.unit.shard_range(self.rank)[0] + work.start
            )  # the piece in the unit's flat buffer
            self.compact.step(t, spans, lr, work.unit.index, origin)
            return
        adamw_step(
            [t[StateKind.MASTER][a:b] for a, b, _, _ in runs],
            [grad[a:b] for a, b, _, _ in runs],
            [t[StateKind.EXP_AVG][a:b] for a, b, _, _ in runs],
            [t[StateKind.EXP_AVG_SQ][a:b] for a, b, _, _ in runs],
            [self.settings.weight_decay if d else 0.0 for _, _, d, _ in runs],
            [step for _, _, _, step in runs],
            lr,
            self.settings,
        )

    def _room_for(self, work: Work) -> bool:
        """Whether loading a piece ahead of time leaves the pool room for the piece being
        stepped."""
        on_host = self.device.type == "cpu" and not self.up
        pool = self.tiers.host_pool if on_host else self.tiers.device_pool
        states = sum(self.formats.nbytes(k, work.numel) for k in self.leased_kinds())
        return (
            2 * (states + work.numel * self.compute_dtype.itemsize)
            <= pool.budget_bytes - pool.leased_bytes
        )

    def leased_kinds(self) -> list[StateKind]:
        """Which of grad/master/moments need a working buffer (not memory on the stepping
        device)."""

        def in_place(home: Tier) -> bool:
            if self.up:
                return home is Tier.GPU
            store_device = self.tiers.device if home is Tier.GPU else torch.device("cpu")
            return home is not Tier.NVME and store_device.type == self.device.type

        return [k for k in STEP_KINDS if not in_place(self.placement.home(k))]
