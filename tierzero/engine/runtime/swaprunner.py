"""The swap runner: executes a swap plan (`tierzero.planning.swapplan`) as the model runs.

The swap runner replays the plan: `acquire(u)` executes every
op up to `u`'s compute and returns its params on the compute device (gathered from every rank);
`release(u)` executes the ops after it. It does not decide what to move; the plan does.
With replicated params (ZeRO stage 1/2) every rank stores whole units: the plan lists no
gathers and a fetch moves the whole unit.

Every rank must issue its collectives in one order, so a gather is issued exactly where the
plan lists it, whatever has landed: if its shard's nvme read is still in flight the host waits
for it there (with a fetch depth of 2 it was issued a use earlier). The gather then runs beside
compute: on gloo's threads, or on NCCL's own stream on a GPU, after the shard's copy event and
the optimizer's last write of it (params homed on the device are read in place) only.

Copies run on the h2d stream (`tierzero.engine.runtime.streams`): a copy into a device buffer waits
only for that buffer's release event (recorded on the compute stream when the unit that last read it
was released), compute waits for the copy's event before it reads, and a staging buffer goes back to
the host pool once its copy's event has happened. An nvme read hands its copy to the h2d stream from
the I/O thread the moment it lands."""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
from collections import deque
from dataclasses import dataclass, field

import torch

from tierzero.config import StateKind, Tier
from tierzero.distributed.comm import InFlight
from tierzero.engine.runtime.layout import RankLayout
from tierzero.engine.runtime.shards import Shards
from tierzero.engine.runtime.streams import Event, Streams
from tierzero.engine.runtime.tiers import Tiers
from tierzero.errors import TierzeroError
from tierzero.layout.keys import shard_key
from tierzero.models.nf4_shard import CodedShard
from tierzero.planning.placement import Link
from tierzero.planning.swapplan import Op, SwapOp, SwapPlan
from tierzero.storage.base import BudgetExceededError, TierStore


class ShardStatus(str, enum.Enum):
    """Where a param shard is on its way to the compute device (DeepSpeed's per-partition
    status)."""

    NOT_AVAILABLE = "not_available"
    IN_FLIGHT = "in_flight"  # a fetch is issued: an nvme read and/or a host->device copy
    AVAILABLE = "available"  # on the device, usable once compute has waited for its copy


@dataclass
class ParamShard:
    """One record per param shard on its way to (or on) the compute device."""

    unit: int
    home: Tier
    status: ShardStatus = ShardStatus.NOT_AVAILABLE
    device_buf: torch.Tensor | None = None
    staging: torch.Tensor | None = None
    future: concurrent.futures.Future | None = None  # an nvme read; its result is the copy's event
    event: Event = None  # the host->device copy's
    # the optimizer's last write of this shard where it lives on the device (params homed on the
    # GPU): the next pass's compute and all-gather read the store itself, so they wait for it
    written: Event = None
    # an NF4 base's shard, landed coded in `device_buf`'s tail and not yet decoded (`CodedShard`)
    coded: CodedShard | None = None
    # several ranks: its uses' all-gathers, oldest first (a tied unit's next use may be gathered
    # before this one's is taken)
    gathered: deque[InFlight] = field(default_factory=deque)


class SwapRunner:
    """Executes a swap plan over the tiers, counting bytes moved and time spent waiting."""

    def __init__(self, layout: RankLayout, tiers: Tiers, shards: Shards) -> None:
        """Params on nvme are stored per piece (`layout.piece_numel`: the optimizer writes them
        so); `shards` names their keys and holds an NF4 base's coded shards."""
        self.layout, self.shards, self.transfers = layout, shards, tiers.stats
        self.tiers, self.streams, self.comm = tiers, tiers.streams, layout.comm
        self.records = {u.index: ParamShard(u.index, layout.placement.param) for u in layout.units}
        self.plan: SwapPlan | None = None
        self._cursor = 0

    def begin(self, plan: SwapPlan) -> None:
        self.plan, self._cursor = plan, 0

    def acquire(self, unit: int) -> torch.Tensor:
        """Run the plan up to `unit`'s compute; return its params, ready on the device (its shard
        on one rank; with several, the full flat buffer gathered from every rank's shard)."""
        self._run_until(Op.WAIT, unit)
        record = self.records[unit]
        self._wait(record)
        gathered = record.gathered.popleft() if record.gathered else None
        self._run_until(Op.COMPUTE, unit)  # the next use's gathers, beside this compute
        if (
            self.comm.world_size == 1 or self.layout.units[unit].replicated
        ):  # the whole unit is stored here
            return self._shard(unit)
        assert gathered is not None, (
            f"the swap plan lists no gather of unit {unit} before its compute"
        )
        with self.transfers.waiting():
            full = gathered.wait()  # sync point: the host on gloo, the compute stream on NCCL
        self.streams.keep_alive(full, self.streams.compute)
        return full

    def written(self, unit: int, event: Event) -> None:
        """The optimizer has issued a write of `unit`'s param shard in its home, done at `event`
        (a later write of the unit is on the same stream, so the latest event covers all)."""
        self.records[unit].written = event

    def release(self, unit: int) -> None:
        """Run the plan's ops after `unit`'s compute, up to the next wait."""
        assert self.plan is not None
        while self._cursor < len(self.plan.ops) and self.plan.ops[self._cursor].op is not Op.WAIT:
            op = self.plan.ops[self._cursor]
            self._cursor += 1
            self._execute(op)
        self.tiers.pending.reap()

    def finish(self) -> None:
        """End the pass: every op of the plan must have run, nothing may stay resident."""
        assert self.plan is not None
        self.release(-1)  # the releases left at the end of the plan
        if self._cursor != len(self.plan.ops):
            raise RuntimeError(
                f"the model ran {self._cursor} of {len(self.plan.ops)} planned swap ops; "
                "it must call its blocks once each, in order"
            )
        self.plan = None

    def abort(self) -> None:
        """Drop every device copy after an error in the middle of a pass."""
        for record in self.records.values():
            if record.future is not None:
                record.future.exception()  # let the read finish before its buffer goes back
                # the read may have failed: its cache entry must not be served later
                self.tiers.host_pool.cache_drop(
                    shard_key(StateKind.PARAM, record.unit, self.layout.rank)
                )
            self._drop(record)
        self.plan = None

    # -- ops --------------------------------------------------------------------------------

    def _run_until(self, stop: Op, unit: int) -> None:
        assert self.plan is not None, "SwapRunner.begin(plan) first"
        while True:
            if self._cursor >= len(self.plan.ops):
                raise RuntimeError(
                    f"unit {unit} was used but the swap plan has ended; the model "
                    "must call its blocks once each, in order"
                )
            op = self.plan.ops[self._cursor]
            self._cursor += 1
            if op.op is stop:
                if op.unit != unit:
                    raise RuntimeError(
                        f"the model used unit {unit} where the swap plan expected "
                        f"unit {op.unit}; it must call its blocks in order"
                    )
                return
            self._execute(op)

    def _execute(self, op: SwapOp) -> None:
        record = self.records[op.unit]
        if op.op is Op.FETCH:
            try:
                self._fetch(
                    record, wait=False
                )  # autograd's thread issues; it never waits for a job here
            except BudgetExceededError:
                self._drop(record)  # a tight budget: this unit is fetched at its wait instead
        elif op.op is Op.RELEASE:
            self._drop(record)
        elif op.op is Op.GATHER:
            self._wait(
                record
            )  # an nvme read still in flight is waited for: see the module docstring
            record.gathered.append(self._issue_gather(record))

    def _issue_gather(self, record: ParamShard) -> InFlight:
        """Start the all-gather of the unit's shard on the comm stream, after its copy's event
        and the optimizer's write of it (compute keeps running); `InFlight.wait` orders compute
        after it."""
        self.streams.wait(self.streams.comm, record.event)
        self.streams.wait(self.streams.comm, record.written)
        with self.streams.current(self.streams.comm):
            return self.comm.all_gather_async(self._shard(record.unit))

    def _fetch(self, record: ParamShard, wait: bool = True) -> None:
        """Start moving the unit's shard to the device. `wait=False` (a look-ahead fetch): a
        buffer the pools do not have now fails the fetch instead of waiting for a transfer."""
        if record.status is not ShardStatus.NOT_AVAILABLE:
            return
        unit = self.layout.units[record.unit]
        key = shard_key(StateKind.PARAM, unit.index, self.layout.rank)
        coded = self.shards.coded.get(unit.index)
        itemsize = self.layout.dtype.itemsize
        nbytes = unit.param_numel * itemsize if coded is None else coded.stored_nbytes
        if record.home is Tier.GPU:
            # resident in the device store: a view, no copy, read once the step's write is done
            self.streams.wait(self.streams.compute, record.written)
            record.status = ShardStatus.AVAILABLE
            return
        buf = self.tiers.lease_device(unit.param_numel * itemsize, wait)
        # The copy into this buffer waits for its release by the compute that last read it, and
        # for nothing else. A fresh block may be memory torch's allocator just freed from
        # compute, so it waits for compute as it is now (rare: the pool reuses its blocks).
        ready = self.tiers.device_pool.take_ready(buf)
        if ready is None:
            ready = self.streams.record(self.streams.compute)
        record.device_buf = buf.view(self.layout.dtype)
        record.status = ShardStatus.IN_FLIGHT
        # an NF4 base lands coded in the buffer's tail, decoded in place at the unit's wait
        landing = record.device_buf if coded is None else coded.tail(record.device_buf)
        record.coded = coded
        if record.home is Tier.HOST:
            self.transfers.add_bytes(Link.HOST_TO_GPU, nbytes)
            record.event = self.streams.copy(
                landing, self.tiers.stores[Tier.HOST].view(key), self.streams.h2d, after=ready
            )
            return
        cached = self.tiers.host_pool.cache_get(key)
        if (
            cached is not None
        ):  # still in RAM since its last use (backward replays forward reversed)
            record.staging = cached.view(self.layout.dtype)
            record.event = self.streams.copy(landing, record.staging, self.streams.h2d, after=ready)
            self.transfers.add_bytes(Link.HOST_TO_GPU, nbytes)
            self.transfers.add_cache_hit(nbytes)
            return
        # (a failed look-ahead lease leaves `device_buf` to `_drop`, which gives it back)
        record.staging = self.tiers.lease_host(nbytes, wait).view(self.layout.dtype)
        self.transfers.add_bytes(Link.HOST_TO_GPU, nbytes)
        # cached from now on: the pool evicts it (least recently used first) when space is short
        self.tiers.host_pool.cache_put(key, record.staging.view(torch.uint8))
        keys = self.shards.keys(StateKind.PARAM, unit)
        record.future = self.tiers.submit(
            _read_then_copy(
                self.tiers.stores[Tier.NVME], keys, record.staging, self.streams, landing, ready
            )
        )
        self.transfers.add_bytes(Link.NVME_TO_HOST, nbytes)

    def _land(self, record: ParamShard) -> None:
        """Take the copy event of an nvme read (its I/O thread issued the copy as it landed)."""
        assert record.future is not None
        future, record.future = record.future, None
        try:
            record.event = future.result()  # sync point when the read is still in flight
        except BaseException:
            self.tiers.host_pool.cache_drop(
                shard_key(StateKind.PARAM, record.unit, self.layout.rank)
            )
            raise

    def _wait(self, record: ParamShard) -> None:
        if record.status is ShardStatus.AVAILABLE:
            return
        if (
            record.status is ShardStatus.NOT_AVAILABLE
        ):  # its look-ahead fetch did not fit the budget
            self._fetch(record)
        if record.future is not None:
            with self.transfers.waiting():
                self._land(record)
        # the compute stream waits on the GPU; the CPU does not block here
        self.streams.wait(self.streams.compute, record.event)
        if record.coded is not None:  # decoded on the compute stream, where the unit reads it
            assert record.device_buf is not None
            coded, record.coded = record.coded, None
            with self.streams.current(self.streams.compute):
                coded.decode(coded.tail(record.device_buf), record.device_buf)
        if record.staging is not None and self.streams.query(record.event):
            self.tiers.host_pool.give_back(record.staging.view(torch.uint8))  # its copy is done
            record.staging = None
        record.status = ShardStatus.AVAILABLE

    def _drop(self, record: ParamShard) -> None:
        """Give the unit's buffers back: the device buffer with a release event (compute may
        still be reading it on the GPU), the staging buffer once its copy has happened. A gather
        issued ahead and never used (an abort) is waited for first: it reads the shard."""
        while record.gathered:
            try:
                record.gathered.popleft().wait()
            except TierzeroError:
                pass  # the pass is being abandoned; a lost rank is reported by whoever waits next
        if record.future is not None:  # never waited for (an abort): the read lands first
            future, record.future = record.future, None
            if future.exception() is None:
                record.event = future.result()
        if record.device_buf is not None:
            if (
                record.status is not ShardStatus.AVAILABLE
            ):  # compute never waited for the copy: order it now
                self.streams.wait(self.streams.compute, record.event)
            release = self.streams.record(self.streams.compute)
            self.tiers.device_pool.give_back(record.device_buf.view(torch.uint8), ready=release)
            record.device_buf = None
        if record.staging is not None:
            self.tiers.give_back_when_done(record.event, record.staging)
            record.staging = None
        record.event = None
        record.coded = None
        record.status = ShardStatus.NOT_AVAILABLE

    def _shard(self, unit: int) -> torch.Tensor:
        record = self.records[unit]
        if record.home is Tier.GPU:
            return self.tiers.stores[Tier.GPU].view(
                shard_key(StateKind.PARAM, unit, self.layout.rank)
            )
        assert record.device_buf is not None
        return record.device_buf


async def _read_then_copy(
    store: TierStore,
    keys: list[tuple[str, int, int]],
    staging: torch.Tensor,
    streams: Streams,
    device_buf: torch.Tensor,
    ready: Event,
) -> Event:
    """Read a unit's param pieces into `staging`, then at once (on the I/O thread, not at the
    training thread's next plan op) start its copy to `device_buf` after `ready`; its event."""
    await _read_pieces(store, keys, staging)
    return streams.copy(device_buf, staging, streams.h2d, after=ready)


async def _read_pieces(
    store: TierStore, keys: list[tuple[str, int, int]], out: torch.Tensor
) -> None:
    """Read a unit's param pieces into their slices of one buffer, all in flight at once; every
    read has finished (or failed) when this returns, so the buffer is never written late."""
    results = await asyncio.gather(
        *(store.read_into(key, out[a:b]) for key, a, b in keys), return_exceptions=True
    )
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise failed
