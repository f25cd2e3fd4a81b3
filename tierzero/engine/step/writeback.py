"""`PieceWrites`: the write half of `ShardOptimizer`: where a stepped piece's new params and
states go, and the buffers given back once they are there.

After a piece's step, the new params are cast into the compute dtype (`_cast_param`): in place
where params live in memory on the stepping device, else into host staging (the grad's buffer
where it is a host one) and a cached copy of an nvme shard. The I/O loop then writes every
leased state and the staged params to their homes at once (`_write_back`); buffers that an
h2d_write copy still reads go back to the pool when its event has happened (`_settle`).
Bytes are counted on the training thread, in the states' stored formats
(`tierzero.compact.formats`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine

import torch

from tierzero.compact.formats import StateFormats
from tierzero.config import OPTIMIZER_KINDS, Placement, StateKind, Tier
from tierzero.engine.runtime.streams import Event
from tierzero.engine.runtime.tiers import Tiers
from tierzero.engine.runtime.transfers import TransferStats
from tierzero.engine.step.work import Work
from tierzero.layout.keys import piece_key, shard_key
from tierzero.planning.placement import Link
from tierzero.storage.base import TierStore


class PieceWrites:
    """Mixed into `ShardOptimizer`, whose constructor sets these (and which owns `_discard`)."""

    tiers: Tiers
    placement: Placement
    compute_dtype: torch.dtype
    rank: int
    piece_numel: int
    stats: TransferStats
    formats: StateFormats
    master_is_param: bool
    device: torch.device
    up: bool = False  # stepped on the device by choice (`roundtrip`)
    param_written: Callable[[int, Event], None]

    def _is_param(self, kind: StateKind) -> bool:
        """Whether `kind` is the master that is the param: written as the new params, never as
        itself."""
        return kind is StateKind.MASTER and self.master_is_param

    def _across(self, home: Tier) -> bool:
        """Whether `home` is memory on the other side from the step: device memory while it runs
        on the host, host memory while it runs on the device by choice; a transfer on the copy
        streams."""
        if self.up:
            return home is Tier.HOST
        return home is Tier.GPU and self.device.type == "cpu" and self.tiers.streams.separate

    def _give_back(self, buf: torch.Tensor, work: Work | None = None) -> None:
        """A working buffer back to the pool it was leased from (`ShardOptimizer._lease`); a
        device step's with the compute event after its last read (`work.stepped`), which the
        next copy into it waits for."""
        if self.up:
            s = self.tiers.streams
            stepped = work.stepped if work is not None else None
            ready = stepped if stepped is not None else s.record(s.compute)
            self.tiers.device_pool.give_back(buf.view(torch.uint8), ready=ready)
            return
        on_host = buf.device.type == self.device.type == "cpu"
        pool = self.tiers.host_pool if on_host else self.tiers.device_pool
        pool.give_back(buf.view(torch.uint8))

    def _give_back_all(self, work: Work) -> None:
        for buf in work.leased.values():
            self._give_back(buf, work)
        self._give_back_staging(work)

    def _staged(self) -> bool:
        """Whether new params reach their home through host staging: on nvme, or in device
        memory from a host step (from a device step a host home is copied into directly)."""
        home = self.placement.home(StateKind.PARAM)
        return home is Tier.NVME or (self._across(home) and not self.up)

    def _reserve_staging(self, work: Work) -> None:
        """On the leasing thread, before the step: the host buffer the new params will be cast
        into. A master that is the param, leased in host memory, is its own: stepped in place,
        it is the new params already (no copy of the piece). Else the grad's buffer serves
        where it is a host one (the step consumes the grad, and numel compute-dtype values fit
        in its fp32 bytes); only otherwise is one leased."""
        if not self._staged():
            return
        if self.up:
            work.staging[StateKind.PARAM] = self.tiers.lease_host(
                work.numel * self.compute_dtype.itemsize
            )
            return
        master = work.leased.get(StateKind.MASTER)
        if self.master_is_param and master is not None and master.device.type == "cpu":
            work.leased[StateKind.PARAM] = work.leased.pop(StateKind.MASTER)
        elif StateKind.GRAD in work.leased and self.device.type == "cpu":
            work.leased[StateKind.PARAM] = work.leased.pop(StateKind.GRAD)
        else:
            work.leased[StateKind.PARAM] = self.tiers.lease_host(
                work.numel * self.compute_dtype.itemsize
            )

    def _staging(self, work: Work) -> torch.Tensor:
        nbytes = work.numel * self.compute_dtype.itemsize
        staged = work.staging if self.up else work.leased
        return staged[StateKind.PARAM].view(torch.uint8)[:nbytes].view(self.compute_dtype)

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
        if self.up and home is not Tier.GPU:  # down after the step; cached by `_params_landed`
            dst = self._staging(work) if home is Tier.NVME else store.view(key)
            self._params_down(
                work, master, dst if home is Tier.NVME else dst[lo + work.start : lo + work.end]
            )
            return
        if self._staged():
            staged = self._staging(work)
            if staged.data_ptr() != master.data_ptr():  # not a master that is its own staging
                staged.copy_(master)
            cached = self.tiers.host_pool.cache_get(key) if home is Tier.NVME else None
            if cached is not None:
                cached.view(self.compute_dtype)[lo + work.start : lo + work.end].copy_(
                    self._staging(work)
                )
                self.tiers.host_pool.give_back(cached)
            return
        dst = store.view(key)[lo + work.start : lo + work.end]
        if home is Tier.GPU and (self.device.type != "cpu" or self.up):
            s = self.tiers.streams
            self.param_written(work.unit.index, s.copy(dst, master, s.compute))  # cast in the copy
        else:
            dst.copy_(master)  # one memory: cast to the compute dtype in the copy

    def _write(self, work: Work) -> None:
        """From the training thread (`step`): count the piece's writes and hand them to the I/O
        loop."""
        self._count_writes(work)
        if work.produced is None and self._across(self.placement.home(StateKind.PARAM)):
            # what the param write waits for: compute as it is now, done with this pass's params
            work.produced = self.tiers.streams.record(self.tiers.streams.compute)
        future = self.tiers.submit(self._write_back(work))
        self.tiers.pending.add(future, lambda ok: self._settle(work) if ok else self._discard(work))

    def _count_writes(self, work: Work) -> None:
        """The bytes `_write_back` will move, counted on the training thread (the counters are
        its)."""
        for kind in OPTIMIZER_KINDS:
            if kind in work.leased and not self._is_param(kind):
                nbytes = self.formats.nbytes(kind, work.numel)
                if self.up:
                    self._count_down(kind, nbytes)
                else:
                    self._count(self.placement.home(kind), nbytes)
        if self.up:  # the params' copy down is counted as it starts (`_params_down`)
            if self.placement.home(StateKind.PARAM) is Tier.NVME:
                self.stats.add_bytes(Link.HOST_TO_NVME, work.numel * self.compute_dtype.itemsize)
        elif self._staged():
            self._count(
                self.placement.home(StateKind.PARAM), work.numel * self.compute_dtype.itemsize
            )

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
            self._give_back(grad, work)  # consumed by the step
        if self.up:
            writes = [
                self._put_down(k, work, b) for k, b in work.leased.items() if not self._is_param(k)
            ]
            writes.append(self._params_landed(work))
        else:
            writes = [
                self._write_param(work) if kind is StateKind.PARAM else self._put(kind, work, buf)
                for kind, buf in work.leased.items()
                if not self._is_param(kind)
            ]
        done = await asyncio.gather(*(w for w in writes if w is not None), return_exceptions=True)
        failed = [r for r in done if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        for kind in [k for k in work.leased if k not in work.copies]:
            self._give_back(work.leased.pop(kind), work)
        self._give_back_staging(work)

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
            piece = work.unit.param_piece_base(self.piece_numel, self.rank) + work.piece
            return self._write_param_piece(
                store, piece_key(StateKind.PARAM, work.unit.index, self.rank, piece), staged, key
            )
        s = self.tiers.streams
        event = s.copy(
            store.view(key)[lo + work.start : lo + work.end],
            staged,
            s.h2d_write,
            after=work.produced,
        )
        work.copies[StateKind.PARAM] = event
        self.param_written(work.unit.index, event)
        return None

    async def _params_landed(self, work: Work) -> None:
        """A device step's new params, once their copy down has landed: into the cached copy
        of an nvme shard and the drive's piece (a host home was copied into directly)."""
        home, store, key, lo = self._param_home(work)
        if home is Tier.GPU:
            return  # written in place
        await self.tiers.landed(work.param_down)
        if home is not Tier.NVME:
            return
        staged = self._staging(work)
        cached = self.tiers.host_pool.cache_get(key)
        if cached is not None:
            cached.view(self.compute_dtype)[lo + work.start : lo + work.end].copy_(staged)
            self.tiers.host_pool.give_back(cached)
        piece = work.unit.param_piece_base(self.piece_numel, self.rank) + work.piece
        await self._write_param_piece(
            store, piece_key(StateKind.PARAM, work.unit.index, self.rank, piece), staged, key
        )

    async def _write_param_piece(
        self, store: TierStore, piece: str, staged: torch.Tensor, key: str
    ) -> None:
        try:
            await store.write(piece, staged)
        except (
            BaseException
        ):  # the drive does not hold these params: the cache must not serve them either
            self.tiers.host_pool.cache_drop(key)
            raise

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
