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

import torch

from tierzero.dist.comm import Comm
from tierzero.config import StateKind, Tier
from tierzero.layout.partition import Unit
from tierzero.engine.stats import StepStats
from tierzero.engine.tiers import Tiers
from tierzero.layout.keys import shard_key, state_keys
from tierzero.planning.placement import Link


def sync_params(units: list[Unit], tiers: Tiers, home: Tier, comm: Comm, dtype: torch.dtype,
                piece_numel: int, stats: StepStats) -> None:
    """All-gather each replicated unit's updated shard and store the whole unit on this rank.
    Call once the step's param writes have landed (`tiers.pending` drained)."""
    for unit in units:
        if unit.replicated:
            _sync_unit(unit, tiers, home, comm, dtype, piece_numel, stats)
    tiers.pending.drain()  # the next pass reads what was written here


def _sync_unit(unit: Unit, tiers: Tiers, home: Tier, comm: Comm, dtype: torch.dtype,
               piece_numel: int, stats: StepStats) -> None:
    lo, hi = unit.shard_range(comm.rank)
    key = shard_key(StateKind.PARAM, unit.index, comm.rank)
    store = tiers.stores[home]
    if store.capabilities.zero_copy:  # gpu / host homes: the whole unit is one key, viewed in place
        whole = store.view(key)
        full = comm.all_gather(whole[lo:hi].to(tiers.device))  # sync point: the host waits for it
        whole.copy_(full)  # this rank's range is rewritten with the values it already holds
        return
    keys = state_keys(StateKind.PARAM, unit, comm.rank, piece_numel, Tier.NVME)
    mine = tiers.lease_host(unit.shard_numel * dtype.itemsize).view(dtype)
    try:
        for k, a, b in keys:
            if lo <= a < hi:
                tiers.run(store.read_into(k, mine[a - lo:b - lo]))
        stats.add_bytes(Link.NVME_TO_HOST, unit.shard_numel * dtype.itemsize)
        full = comm.all_gather(mine.to(tiers.device)).cpu()
    finally:
        tiers.host_pool.give_back(mine.view(torch.uint8))
    cached = tiers.host_pool.cache_get(key)
    if cached is not None:  # the LRU copy of the unit must not serve the old values
        cached.view(dtype).copy_(full)
        tiers.host_pool.give_back(cached)
    for k, a, b in keys:
        if lo <= a < hi:
            continue  # written by this rank's optimizer
        staged = tiers.lease_host((b - a) * dtype.itemsize).view(dtype)
        staged.copy_(full[a:b])
        future = tiers.submit(store.write(k, staged))
        tiers.pending.add(future, lambda ok, s=staged, k=key: _written(tiers, k, s, ok))
        stats.add_bytes(Link.HOST_TO_NVME, (b - a) * dtype.itemsize)


def _written(tiers: Tiers, key: str, staged: torch.Tensor, ok: bool) -> None:
    if not ok:  # the drive does not hold these params: the cache must not serve them either
        tiers.host_pool.cache_drop(key)
    tiers.host_pool.give_back(staged.view(torch.uint8))
