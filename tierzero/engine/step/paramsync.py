"""Replicated params after a step (ZeRO stage 1/2): every rank gets every rank's new values.

With replicated params each rank's param home holds whole units, so forward and backward
gather nothing; the optimizer still steps only this rank's shard (master and Adam states are
partitioned) and writes the new compute-dtype values into this rank's range of the unit
(`ShardOptimizer._write_param`). This module then runs the one all-gather per unit per step:
read this rank's range back from the home, all-gather it on the compute device, and write
the other ranks' ranges. It never steps anything and never decides what is replicated.

Every rank syncs the units in one order (their index order), so the collectives match.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from tierzero.config import StateKind, Tier
from tierzero.distributed.comm import Comm, InFlight
from tierzero.engine.runtime.layout import RankLayout
from tierzero.engine.runtime.streams import Event
from tierzero.engine.runtime.tiers import Tiers
from tierzero.layout.keys import shard_key, state_keys
from tierzero.layout.partition import Unit
from tierzero.planning.placement import Link

IN_FLIGHT = 2  # units whose all-gathers run at once: a unit's full buffer each on the device


def sync_params(layout: RankLayout, tiers: Tiers) -> None:
    """All-gather each replicated unit's updated shard and store the whole unit on this rank.
    Call once the step's param writes have landed (`tiers.pending` drained).

    Nothing here synchronises the device per unit: shards go up on the h2d_write stream, the
    gathers run beside one another (`IN_FLIGHT` at once), whole units come back on the d2h
    stream, and the host waits once, for the last copy (d2h copies land in order); params on
    nvme wait for each unit's copy event before its pieces are written."""
    inflight: deque[tuple[Unit, InFlight, Callable[[], None]]] = deque()
    last: Event = None
    for unit in (u for u in layout.units if u.replicated):
        inflight.append((unit, *_gather(unit, layout, tiers)))
        if len(inflight) > IN_FLIGHT:
            last = _store(*inflight.popleft(), layout, tiers) or last
    while inflight:
        last = _store(*inflight.popleft(), layout, tiers) or last
    tiers.streams.host_wait(last)  # the one sync point: the last unit's copy to the host
    tiers.pending.drain()  # the next pass reads what was written here


def _gather(unit: Unit, layout: RankLayout, tiers: Tiers) -> tuple[InFlight, Callable[[], None]]:
    """Start gathering `unit` from this rank's range of its home; and what gives its buffers
    back once the gather has been waited for."""
    comm, dtype = layout.comm, layout.dtype
    lo, hi = unit.shard_range(comm.rank)
    store = tiers.stores[layout.placement.param]
    if store.capabilities.zero_copy:  # gpu / host homes: the whole unit is one key, viewed in place
        return _gather_from(
            store.view(shard_key(StateKind.PARAM, unit.index, comm.rank))[lo:hi], tiers, comm
        )
    mine = tiers.lease_host(unit.shard_numel * dtype.itemsize).view(dtype)
    try:
        for k, a, b in state_keys(StateKind.PARAM, unit, comm.rank, layout.piece_numel, Tier.NVME):
            if lo <= a < hi:
                tiers.run(store.read_into(k, mine[a - lo : b - lo]))
        tiers.stats.add_bytes(Link.NVME_TO_HOST, unit.shard_numel * dtype.itemsize)
        return _gather_from(mine, tiers, comm, leased=True)
    except BaseException:
        tiers.host_pool.give_back(mine.view(torch.uint8))
        raise


def _gather_from(
    src: torch.Tensor, tiers: Tiers, comm: Comm, leased: bool = False
) -> tuple[InFlight, Callable[[], None]]:
    """All-gather `src` on the compute device: in place there, else copied up on the h2d_write
    stream into a device pool buffer, given back once compute is past the gather (the host
    does not wait for the copy: compute does, and NCCL's stream waits for compute as the
    gather is issued). A `leased` host `src` goes back once nothing reads it."""
    give_back_src = (
        (lambda: tiers.host_pool.give_back(src.view(torch.uint8))) if leased else (lambda: None)
    )
    if src.device == tiers.device:
        return comm.all_gather_async(src), give_back_src
    s = tiers.streams
    buf = tiers.lease_device(src.numel() * src.element_size())
    dev = buf.view(src.dtype)
    copied = s.copy(dev, src, s.h2d_write, after=tiers.device_pool.take_ready(buf))
    if leased:
        tiers.give_back_when_done(copied, src)
    s.wait(s.compute, copied)
    return comm.all_gather_async(dev), lambda: tiers.device_pool.give_back(
        buf, ready=s.record(s.compute)
    )


def _store(
    unit: Unit, gathered: InFlight, release: Callable[[], None], layout: RankLayout, tiers: Tiers
) -> Event:
    """Write the gathered unit into its home; the event of its copy to the host, if any."""
    comm, dtype = layout.comm, layout.dtype
    s = tiers.streams
    key = shard_key(StateKind.PARAM, unit.index, comm.rank)
    store = tiers.stores[layout.placement.param]
    full = gathered.wait()  # the host on gloo, the compute stream on NCCL
    release()
    if store.capabilities.zero_copy:
        whole = store.view(key)
        if whole.device == full.device:
            whole.copy_(full)  # this rank's range is rewritten with the values it already holds
            return None
        done = s.copy(whole, full, s.d2h, after=s.record(s.compute))
        s.keep_alive(full, s.d2h)
        return done
    lo, hi = unit.shard_range(comm.rank)
    host = None
    if full.device.type != "cpu":
        host = tiers.lease_host(full.numel() * full.element_size()).view(full.dtype)
        s.keep_alive(full, s.d2h)
        s.host_wait(s.copy(host, full, s.d2h, after=s.record(s.compute)))  # this copy's event only
        full = host
    cached = tiers.host_pool.cache_get(key)
    if cached is not None:  # the LRU copy of the unit must not serve the old values
        cached.view(dtype).copy_(full)
        tiers.host_pool.give_back(cached)
    for k, a, b in state_keys(StateKind.PARAM, unit, comm.rank, layout.piece_numel, Tier.NVME):
        if lo <= a < hi:
            continue  # written by this rank's optimizer
        staged = tiers.lease_host((b - a) * dtype.itemsize).view(dtype)
        staged.copy_(full[a:b])
        future = tiers.submit(store.write(k, staged))
        tiers.pending.add(future, lambda ok, st=staged: _written(tiers, key, st, ok))
        tiers.stats.add_bytes(Link.HOST_TO_NVME, (b - a) * dtype.itemsize)
    if host is not None:  # its bytes are staged or cached above
        tiers.host_pool.give_back(host.view(torch.uint8))
    return None


def _written(tiers: Tiers, key: str, staged: torch.Tensor, ok: bool) -> None:
    if not ok:  # the drive does not hold these params: the cache must not serve them either
        tiers.host_pool.cache_drop(key)
    tiers.host_pool.give_back(staged.view(torch.uint8))
