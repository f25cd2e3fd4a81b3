"""`RoundTrip`: a step on the compute device by choice (`Placement.optimizer`): the states not
homed there come up before a piece's step and go back after it, on the copy streams.

A host-homed state is copied up from its home on the h2d stream and back into it on the d2h
stream after the step's compute event; an nvme-homed one is read into a leased host buffer
(`Work.staging`) and copied up from there, and copied back into that buffer and written to the
drive. The piece's grad, made on the device, is stepped where it is; new params go down on
the d2h stream into a host param home (or into staging for an nvme one, whose cached copy and
drive piece the I/O loop then writes). Each copy is awaited on the I/O loop
(`Tiers.landed`), never by an I/O worker or the training thread; the step's writes finish
before `ShardOptimizer.step` returns, so the next pass reads what they wrote. The step itself is
the host's arithmetic (`planning.stepdevice`): the bits do not depend on the side.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Coroutine

import torch

from tierzero.config import Placement, StateKind, Tier
from tierzero.engine.runtime.streams import Event
from tierzero.engine.runtime.tiers import Tiers
from tierzero.engine.runtime.transfers import TransferStats
from tierzero.engine.step.work import Work
from tierzero.layout.keys import piece_key
from tierzero.planning.placement import Link


class RoundTrip:
    """Mixed into `ShardOptimizer`, whose constructor sets these (and which owns `_source`)."""

    tiers: Tiers
    placement: Placement
    rank: int
    stats: TransferStats

    def _bring_up(
        self, kind: StateKind, work: Work, buf: torch.Tensor, previous: bool
    ) -> concurrent.futures.Future:
        """Start bringing a state piece up into its device buffer `buf`; a future that completes
        when it has landed. `previous`: a re-step's held generation on the drive."""
        home = self.placement.home(kind)
        store = self.tiers.stores[home]
        s = self.tiers.streams
        self.stats.add_bytes(Link.HOST_TO_GPU, buf.nbytes)
        # the copy into the buffer waits for its release by the compute that last read it (a
        # fresh block: for compute as it is now)
        ready = self.tiers.device_pool.take_ready(buf)
        ready = s.record(s.compute) if ready is None else ready
        if home is not Tier.NVME:
            source = self._source(kind, work, store)
            return self.tiers.when_done(s.copy(buf, source, s.h2d, after=ready))
        staging = work.staging[kind]
        key = self._source(kind, work)
        read = (
            store.read_into(key, staging, previous=True)
            if previous
            else store.read_into(key, staging)
        )
        self.stats.add_bytes(Link.NVME_TO_HOST, staging.nbytes)
        return self.tiers.submit(self._up_after(read, buf, staging, ready))

    async def _up_after(
        self, read: Coroutine, buf: torch.Tensor, staging: torch.Tensor, ready: Event
    ) -> None:
        await read
        s = self.tiers.streams
        await self.tiers.landed(s.copy(buf, staging, s.h2d, after=ready))

    def _count_down(self, kind: StateKind, nbytes: int) -> None:
        """A state's bytes going back to its home (`_put_down`), counted per link."""
        self.stats.add_bytes(Link.GPU_TO_HOST, nbytes)
        if self.placement.home(kind) is Tier.NVME:
            self.stats.add_bytes(Link.HOST_TO_NVME, nbytes)

    async def _put_down(self, kind: StateKind, work: Work, buf: torch.Tensor) -> None:
        """Copy a stepped state piece down after the step's compute, into its host home or its
        staging, and write that to the drive."""
        home = self.placement.home(kind)
        store = self.tiers.stores[home]
        s = self.tiers.streams
        key = piece_key(kind, work.unit.index, self.rank, work.piece)
        target = work.staging[kind] if home is Tier.NVME else store.view(key)
        await self.tiers.landed(s.copy(target, buf, s.d2h, after=work.stepped))
        if home is Tier.NVME:
            await store.write(key, target)

    def _params_down(self, work: Work, master: torch.Tensor, target: torch.Tensor) -> None:
        """Start the new params' copy down (cast to the compute dtype in it) after the step's
        compute, issued on its stream."""
        s = self.tiers.streams
        work.param_down = s.copy(target, master, s.d2h, after=s.record(s.compute))
        self.stats.add_bytes(Link.GPU_TO_HOST, target.nbytes)

    def _give_back_staging(self, work: Work) -> None:
        for buf in work.staging.values():
            self.tiers.host_pool.give_back(buf.view(torch.uint8))
        work.staging.clear()
