"""CPU Adam over shards streamed through the tiers: read shard j+1, step j, write j-1.

Per unit shard, the optimizer needs `grad`, `master`, `exp_avg` and `exp_avg_sq`. A state
whose home is a memory tier on the stepping device is used in place (zero copy); any other
is read into a leased buffer, `prefetch_depth` units ahead. After torch's AdamW updates the
shard, off-device states are written back and the new compute-dtype `param` shard goes to its
home. Writes complete in the background; their buffers return to the pool as they finish.
The step runs on the compute device only when master and both moments live there.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import torch

from tierzero.adamw import adamw_step
from tierzero.config import Config, Placement, StateKind, Tier
from tierzero.partition import Unit
from tierzero.stats import StepStats
from tierzero.tiers import Tiers, shard_key

OPT_KINDS = (StateKind.GRAD, StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)


@dataclass
class Work:
    """One unit's optimizer shards on the stepping device, and which of them are borrowed."""

    unit: Unit
    tensors: dict[StateKind, torch.Tensor] = field(default_factory=dict)
    leased: dict[StateKind, torch.Tensor] = field(default_factory=dict)  # kind -> leased buffer
    futures: list = field(default_factory=list)


class ShardOptimizer:
    def __init__(self, units: list[Unit], tiers: Tiers, placement: Placement, compute_dtype: torch.dtype,
                 rank: int, config: Config, stats: StepStats) -> None:
        self.units = units
        self.tiers = tiers
        self.placement = placement
        self.compute_dtype = compute_dtype
        self.rank = rank
        self.config = config
        self.stats = stats
        on_gpu = all(placement.home(k) is Tier.GPU for k in OPT_KINDS[1:])
        self.device = tiers.device if on_gpu else torch.device("cpu")
        self._prefetched: dict[int, Work] = {}

    def step(self, step_count: int, lr: float, grad_coef: torch.Tensor | None) -> None:
        """One AdamW update of every unit's shard; returns when every write is durable in RAM
        or handed to the I/O loop and finished (the next pass reads what this one wrote)."""
        depth = max(1, self.config.prefetch_depth)
        loads: deque[Work] = deque()
        issued = 0
        for j in range(len(self.units)):
            while issued < min(len(self.units), j + depth):  # keep `depth` units loaded ahead
                if issued > j and not self._room_for(self.units[issued]):
                    break  # a tight budget: read ahead less rather than fail
                loads.append(self._load(self.units[issued], with_grad=True))
                issued += 1
            work = loads.popleft()
            self._wait(work)
            self._step(work, step_count, lr, grad_coef)
            self._write(work)
            self.tiers.pending.reap()
        self.tiers.pending.drain()

    def prefetch(self, unit: Unit) -> None:
        """Start reading `unit`'s master and moments now (overlap_step: while backward computes)."""
        if unit.index not in self._prefetched:
            self._prefetched[unit.index] = self._load(unit)

    def discard_prefetched(self) -> None:
        """After an error mid-backward: let prefetches land, then return their buffers."""
        for work in self._prefetched.values():
            self._discard(work)
        self._prefetched.clear()

    def _discard(self, work: Work) -> None:
        """Give back a unit's buffers without writing anything (its reads or step failed)."""
        for future in work.futures:
            future.exception()  # wait: an I/O thread may still be filling the buffer
        for buf in work.leased.values():
            self._give_back(buf)

    def step_unit(self, unit: Unit, grad: torch.Tensor, owned: bool, step_count: int, lr: float,
                  grad_coef: torch.Tensor | None = None) -> None:
        """Step one unit as soon as its final grad exists (overlap_step), off the training thread.

        Its states were prefetched (or are read now); the AdamW step runs on an I/O thread once
        they land (torch releases the GIL, so backward continues meanwhile); the writes are
        issued when the training thread next reaps the pending queue.
        """
        work = self._prefetched.pop(unit.index, None) or self._load(unit)
        self._attach_grad(work, grad, owned)
        future = self.tiers.submit(self._step_when_loaded(work, step_count, lr, grad_coef))
        self.tiers.pending.add(future, lambda ok: self._write(work) if ok else self._discard(work))

    async def _step_when_loaded(self, work: Work, step_count: int, lr: float,
                                grad_coef: torch.Tensor | None) -> None:
        for future in work.futures:
            await asyncio.wrap_future(future)
        await asyncio.get_running_loop().run_in_executor(None, self._step, work, step_count, lr, grad_coef)

    def _attach_grad(self, work: Work, grad: torch.Tensor, owned: bool) -> None:
        """Use the finished grad shard handed over by backward (owned: a lease to give back)."""
        if grad.device == self.device:
            work.tensors[StateKind.GRAD] = grad
            if owned:
                work.leased[StateKind.GRAD] = grad
            return
        work.tensors[StateKind.GRAD] = work.leased[StateKind.GRAD] = self._lease(grad.numel() * 4).view(torch.float32)
        work.leased[StateKind.GRAD].copy_(grad)
        if owned:
            self.tiers.host_pool.give_back(grad.view(torch.uint8))

    def _load(self, unit: Unit, with_grad: bool = False) -> Work:
        """Start bringing `unit`'s optimizer states (and its grad shard, if asked) to the stepping device."""
        work = Work(unit)
        for kind in OPT_KINDS if with_grad else OPT_KINDS[1:]:
            home = self.placement.home(kind)
            key = shard_key(kind, unit.index, self.rank)
            store = self.tiers.stores[home]
            if store.capabilities.zero_copy:
                view = store.view(key)
                if view.device == self.device:
                    work.tensors[kind] = view
                    continue
            buf = self._lease(unit.shard_numel * 4).view(torch.float32)
            work.tensors[kind] = work.leased[kind] = buf
            if home is Tier.NVME:
                work.futures.append(self.tiers.submit(store.read_into(key, buf)))
                self.stats.add_bytes("nvme->host", buf.numel() * 4)
            else:
                buf.copy_(store.view(key))
                self.stats.add_bytes(f"{home.value}->{'gpu' if self.device.type == 'cuda' else 'host'}",
                                     buf.numel() * 4)
        return work

    def _lease(self, nbytes: int) -> torch.Tensor:
        """A working buffer on the stepping device (host pool for CPU steps)."""
        if self.device.type == "cpu":
            return self.tiers.lease_host(nbytes)
        return self.tiers.lease_device(nbytes)

    def _give_back(self, buf: torch.Tensor) -> None:
        pool = self.tiers.host_pool if buf.device.type == "cpu" and self.device.type == "cpu" \
            else self.tiers.device_pool
        pool.give_back(buf.view(torch.uint8))

    def _wait(self, work: Work) -> None:
        with self.stats.waiting():
            for future in work.futures:
                future.result()
        work.futures.clear()

    def _step(self, work: Work, step_count: int, lr: float, grad_coef: torch.Tensor | None) -> None:
        t = work.tensors
        grad = t[StateKind.GRAD]
        if grad_coef is not None:  # clipping: the grad shard is consumed here, so scale in place
            grad.mul_(grad_coef.to(grad.device))
        segments = work.unit.segments(self.rank)
        adamw_step([t[StateKind.MASTER][a:b] for a, b, _ in segments],
                   [grad[a:b] for a, b, _ in segments],
                   [t[StateKind.EXP_AVG][a:b] for a, b, _ in segments],
                   [t[StateKind.EXP_AVG_SQ][a:b] for a, b, _ in segments],
                   [self.config.weight_decay if d else 0.0 for _, _, d in segments],
                   step_count, lr, self.config)

    def _write(self, work: Work) -> None:
        unit = work.unit
        for kind, buf in work.leased.items():
            if kind is StateKind.GRAD:
                self._give_back(buf)
                continue
            self._put(kind, unit, buf, owned=True)
        master = work.tensors[StateKind.MASTER]
        home = self.placement.home(StateKind.PARAM)
        store = self.tiers.stores[home]
        key = shard_key(StateKind.PARAM, unit.index, self.rank)
        if store.capabilities.zero_copy:
            store.view(key).copy_(master)  # cast to the compute dtype in the copy
            return
        staged = self.tiers.lease_host(unit.shard_numel * self.compute_dtype.itemsize).view(self.compute_dtype)
        staged.copy_(master)
        # the new param shard replaces the cached old one at once, so no pass can read it stale
        self.tiers.host_pool.cache_put(key, staged.view(torch.uint8))
        future = self.tiers.submit(store.write(key, staged))
        self.tiers.pending.add(future, lambda ok: self._release_param(key, staged, ok))
        self.stats.add_bytes("host->nvme", staged.numel() * staged.element_size())

    def _release_param(self, key: str, staged: torch.Tensor, ok: bool) -> None:
        if not ok:  # the drive does not hold these params: the cache must not serve them either
            self.tiers.host_pool.cache_drop(key)
        self.tiers.host_pool.give_back(staged.view(torch.uint8))

    def _room_for(self, unit: Unit) -> bool:
        """Whether loading `unit` ahead of time leaves the pool room for the unit being stepped."""
        pool = self.tiers.host_pool if self.device.type == "cpu" else self.tiers.device_pool
        states = self.leased_kinds() * unit.shard_numel * 4
        staging = unit.shard_numel * self.compute_dtype.itemsize
        return 2 * (states + staging) <= pool.budget_bytes - pool.leased_bytes

    def leased_kinds(self) -> int:
        """How many of grad/master/moments need a working buffer (not memory on the stepping device)."""
        def in_place(home: Tier) -> bool:
            store_device = self.tiers.device if home is Tier.GPU else torch.device("cpu")
            return home is not Tier.NVME and store_device.type == self.device.type
        return sum(1 for k in OPT_KINDS if not in_place(self.placement.home(k)))

    def _put(self, kind: StateKind, unit: Unit, buf: torch.Tensor, owned: bool) -> None:
        """Write a leased working buffer back to `kind`'s home, then return it to its pool."""
        home = self.placement.home(kind)
        store = self.tiers.stores[home]
        key = shard_key(kind, unit.index, self.rank)
        if home is Tier.NVME:
            future = self.tiers.submit(store.write(key, buf))
            self.tiers.pending.add(future, lambda ok: self._give_back(buf))
            self.stats.add_bytes("host->nvme", buf.numel() * buf.element_size())
            return
        store.view(key).copy_(buf)
        if owned:
            self._give_back(buf)
