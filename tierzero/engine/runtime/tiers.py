"""The tiers an engine runs on: the I/O loop, the host and device pools, one store per tier, and
the compute device's streams (`tierzero.engine.runtime.streams`).

It owns their lifetimes (open in dependency order, close in reverse, even after errors), the
key of every shard, and leasing with back-pressure: when a pool is full, wait for the oldest
pending transfer to give its buffer back before failing.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
from collections import deque
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch

from tierzero.config import FormatSettings, StreamSettings, Tier, Tiering
from tierzero.engine.runtime import streams as streams_mod
from tierzero.engine.runtime.transfers import TransferStats
from tierzero.errors import ConfigError
from tierzero.planning.machine import default_budgets
from tierzero.planning.memory_model import MemoryModel
from tierzero.storage.base import BudgetExceededError, TierStore
from tierzero.storage.device import DevicePool, DeviceStore
from tierzero.storage.host import HostPool, HostStore
from tierzero.storage.io import IOLoop


class Pending:
    """Transfers in flight, oldest first, each with what to do once it has finished.

    `on_done(ok)` runs only after the transfer has really finished — never while an I/O thread
    may still touch its buffers (a Ctrl-C during the wait leaves the entry queued) — with
    `ok=False` when it failed, so a failed read is never written back as if it had landed.
    """

    def __init__(self, stats: TransferStats | None = None) -> None:
        self._queue: deque[tuple[concurrent.futures.Future, Callable[[bool], None]]] = deque()
        self.stats = stats or TransferStats()  # time blocked here is time waiting on I/O

    def add(self, future: concurrent.futures.Future, on_done: Callable[[bool], None]) -> None:
        self._queue.append((future, on_done))

    def reap(self) -> None:
        """Finish every completed transfer at the head of the queue (non-blocking)."""
        while self._queue and self._queue[0][0].done():
            self.wait_oldest()

    def wait_oldest(self) -> bool:
        if not self._queue:
            return False
        future, on_done = self._queue[0]
        try:
            with self.stats.waiting():
                future.result()  # re-raises the transfer's error here, on the training thread
        except BaseException:
            if not future.done():  # interrupted while waiting: the transfer still owns its buffers
                raise
            self._queue.popleft()
            on_done(False)
            raise
        self._queue.popleft()
        on_done(True)
        return True

    def drain(self) -> None:
        while self.wait_oldest():
            pass

    def __len__(self) -> int:
        return len(self._queue)


class Tiers:
    def __init__(
        self,
        tiering: Tiering,
        streaming: StreamSettings,
        formats: FormatSettings,
        device: torch.device,
        homes: set[Tier],
        rank: int | None = None,
        stats: TransferStats | None = None,
        local_ranks: int = 1,
    ) -> None:
        """`local_ranks`: the ranks on this machine, which split its default budgets; `formats`
        name the int8 layout in the NVMe store's attributes."""
        self.tiering, self.streaming, self.formats = tiering, streaming, formats
        self.stats = stats or TransferStats()
        # ranks on one machine share the drives but never a store directory (each takes a lock)
        self.nvme_paths = [
            str(Path(p) / f"rank{rank}") if rank is not None else p for p in tiering.nvme_path
        ]
        self.device = device
        self.homes = homes
        host, gpu = default_budgets(device, local_ranks)
        # what each pool may hold; `share_budgets` takes out what the pools never see
        self.host_budget = tiering.host_budget or host
        self.gpu_budget = tiering.gpu_budget or gpu
        self.total_budgets = {Tier.HOST: self.host_budget, Tier.GPU: self.gpu_budget}
        self.io: IOLoop | None = None
        self.host_pool: HostPool | None = None
        self.host_blocks: dict[
            int, int
        ] = {}  # the host pool's size classes and blocks to pin at open
        self.device_pool: DevicePool | None = None
        self.stores: dict[Tier, TierStore] = {}
        self.streams: streams_mod.Streams | None = None
        self.pending = Pending(self.stats)
        self._opened: list[Any] = []
        self._flushing: concurrent.futures.Future | None = None  # `flush_behind`'s, in flight

    def share_budgets(self, device_pool_bytes: int) -> None:
        """On the CPU device the gpu tier is host memory: its pool's budget is what the memory
        model says it holds (at most --gpu-budget, when given), carved out of the host budget,
        so the two pools never promise the same RAM twice. Call before `open()`."""
        if self.device.type == "cpu":
            if self.tiering.gpu_budget is None:
                self.total_budgets[Tier.GPU] = device_pool_bytes
            self.gpu_budget = min(self.total_budgets[Tier.GPU], device_pool_bytes)
            self.host_budget -= self.gpu_budget

    def reserve(self, tier: Tier, nbytes: int) -> None:
        """Take `nbytes` of `tier`'s budget from its pool for memory the pools never see (torch's
        allocations: activations, unit grads). On the CPU device both tiers are RAM and the host
        pool gives it up. An open pool shrinks at once (`BufferPool.set_budget`)."""
        pool_tier = Tier.HOST if self.device.type == "cpu" else tier
        if pool_tier is Tier.HOST:
            self.host_budget -= nbytes
            pool, budget = self.host_pool, self.host_budget
        else:
            self.gpu_budget -= nbytes
            pool, budget = self.device_pool, self.gpu_budget
        if pool is not None and pool.is_open:
            pool.set_budget(max(1, budget))

    def check_paths(self) -> None:
        """Refuse unusable nvme paths without writing anything (called at engine construction);
        `open()` creates the directories and proves each writable."""
        if Tier.NVME in self.homes:
            for path in self.tiering.nvme_path:
                _check_nvme_path(Path(path))

    def provision_host(self, memory: MemoryModel) -> None:
        """The CPU device: once the first forward has reserved the activations the host budget
        is final, so the host pool takes it and pins the blocks `memory` provisions under it."""
        if self.device.type == "cpu":
            assert self.host_pool is not None
            self.host_pool.set_budget(max(1, self.host_budget))
            provision = memory.host_provision(self.host_budget)
            self.host_pool.provision(
                {c: n - self.host_blocks.get(c, 0) for c, n in provision.items()}
            )

    def open(self) -> Tiers:
        pin_malloc_thresholds()
        if Tier.NVME in self.homes:
            for path in self.tiering.nvme_path:
                _probe_nvme_path(Path(path))
            for path in self.nvme_paths:
                Path(path).mkdir(exist_ok=True)
        try:
            self.streams = streams_mod.open_streams(self.device)
            self.streams.busy = self.stats.busy  # each host<->device copy's interval
            # host math's OpenMP team on a GPU machine: every core but the training thread's and
            # the I/O loop's (workers sleep in pread/pwrite). On the CPU device torch's default:
            # the model's matmuls run beside it either way.
            math_threads = (
                max(1, len(os.sched_getaffinity(0)) - 2) if self.device.type == "cuda" else None
            )
            self.io = self._open(
                IOLoop(
                    self.streaming.io_threads,
                    functools.partial(streams_mod.bind_thread, self.device),
                    math_threads,
                )
            )
            pin_device = self.device if self.device.type == "cuda" else None  # pin in its context
            # On the CPU device the first forward still takes the batch's activations from the
            # host budget: until then the pool holds no more than the blocks it pins at open.
            pinned = sum(c * n for c, n in self.host_blocks.items())
            budget = (
                self.host_budget
                if self.device.type == "cuda" or not pinned
                else min(self.host_budget, pinned)
            )
            self.host_pool = self._open(
                HostPool(budget, device=pin_device, blocks=self.host_blocks)
            )
            self.device_pool = self._open(DevicePool(self.gpu_budget, self.device))
            self.stores[Tier.HOST] = self._open(HostStore(self.host_pool, self.streams.store_copy))
            self.stores[Tier.GPU] = self._open(
                DeviceStore(self.device_pool, self.streams.store_copy)
            )
            if Tier.NVME in self.homes:
                from tierzero.compact.formats import StateFormats
                from tierzero.storage.nvme.store import NvmeStore

                self.stores[Tier.NVME] = self._open(
                    NvmeStore(
                        self.nvme_paths,
                        chunk_bytes=self.streaming.chunk_bytes,
                        verify_reads={"on": True, "off": False}.get(self.streaming.verify_reads),
                        layout=StateFormats.of(self.formats).layout,
                    )
                )
                self.stores[Tier.NVME].on_busy = self.stats.nvme_busy
        except BaseException:
            self.close()
            raise
        return self

    def _open(self, thing: Any) -> Any:
        thing.open()
        self._opened.append(thing)
        return thing

    def close(self) -> None:
        """Finish transfers, make nvme durable, then stop the I/O loop before anything it uses.

        Idempotent. Even when a transfer failed, the loop is shut down (joining its threads)
        before the stores and pools close, so no I/O thread outlives the buffers it writes.
        """
        try:
            if self.io is not None:
                self.pending.drain()
                self.wait_flush()
                if Tier.NVME in self.stores:
                    self.run(self.stores[Tier.NVME].flush())
        finally:
            if self.io is not None:
                self._opened.remove(self.io)
                self.io.close()
            while self._opened:
                self._opened.pop().close()
            self.io = None
            self.stores.clear()
            self.pending = Pending(self.stats)

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        assert self.io is not None
        return self.io.submit(coro)

    def run(self, coro: Coroutine) -> Any:
        return self.submit(coro).result()

    def flush_behind(self) -> None:
        """After a step: start an NVMe flush without waiting for it, so the blocks the step
        superseded become spares (`storage.nvme.spares`) while the next step runs. Durability is
        the checkpoints' (and `close`'s), which flush and wait. One at a time: the previous
        flush is waited for first, and its failure raised here."""
        if Tier.NVME in self.stores:
            self.wait_flush()
            self._flushing = self.submit(self.stores[Tier.NVME].flush())

    def wait_flush(self) -> None:
        """Wait for the flush `flush_behind` started (if any); raise its failure."""
        flushing, self._flushing = self._flushing, None
        if flushing is not None:
            flushing.result()

    def when_done(self, event: streams_mod.Event) -> concurrent.futures.Future:
        """A future that completes once the stream event `event` has happened: the I/O loop's waiter
        waits for it, so the training thread hands buffers back through `pending` unblocked."""
        assert self.streams is not None
        if self.streams.query(event):
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return done
        return self.submit(self.landed(event))

    def give_back_when_done(self, event: streams_mod.Event, buf: torch.Tensor) -> None:
        """Return the leased host buffer `buf` to its pool once the copy done at `event` has
        happened."""
        staged = buf.view(torch.uint8)
        self.pending.add(self.when_done(event), lambda ok: self.host_pool.give_back(staged))

    async def landed(self, event: streams_mod.Event) -> None:
        """Await a stream event from the I/O loop, never holding an I/O worker while it sleeps
        (on its stream's waiter thread: see `IOLoop.wait_off_workers`)."""
        assert self.streams is not None and self.io is not None
        if not self.streams.query(event):
            await self.io.wait_off_workers(
                self.streams.host_wait, event, lane=self.streams.lane(event)
            )

    def lease_host(self, nbytes: int, wait: bool = True) -> torch.Tensor:
        """A host buffer; when the pool is full, wait for pending transfers to free one first.
        `wait=False` (a prefetch, issued from autograd's thread): take what completed transfers
        have freed, and otherwise raise `BudgetExceededError` rather than block on one."""
        assert self.host_pool is not None
        return _lease(self.host_pool, nbytes, self.pending, wait)

    def lease_device(self, nbytes: int, wait: bool = True) -> torch.Tensor:
        assert self.device_pool is not None
        return _lease(self.device_pool, nbytes, self.pending, wait)

    def peaks(self) -> dict[str, int]:
        assert self.host_pool is not None and self.device_pool is not None
        return {"host": self.host_pool.peak_bytes, "gpu": self.device_pool.peak_bytes}


def pin_malloc_thresholds() -> bool:
    """Make freed tensors go back to the OS, so resident memory tracks live bytes (glibc only).

    glibc raises its mmap threshold to the size of every large block freed (up to 32 MiB) and
    its trim threshold to twice that, so after one large tensor is freed, later ones come from
    heaps that keep freed memory: measured here, RSS reached 1.4-1.8x the live bytes of a CPU
    step. Pinning both thresholds (128 KiB, 1 MiB) keeps RSS within 1% of them, which is what
    lets `--host-budget` bound the process; it costs CPU compute about 20% (fresh pages are
    faulted in for each large tensor), and GPU steps, whose large buffers are the pools'
    own mappings, nothing measurable. Process-wide, once; False where it is not glibc.
    """
    global _MALLOC_PINNED
    if _MALLOC_PINNED is None:
        try:
            libc = ctypes.CDLL("libc.so.6")
            _MALLOC_PINNED = bool(libc.mallopt(_M_MMAP_THRESHOLD, 128 << 10)) and bool(
                libc.mallopt(_M_TRIM_THRESHOLD, 1 << 20)
            )
        except (OSError, AttributeError):
            _MALLOC_PINNED = False
    return _MALLOC_PINNED


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
_MALLOC_PINNED: bool | None = None


def _lease(
    pool: HostPool | DevicePool, nbytes: int, pending: Pending, wait: bool = True
) -> torch.Tensor:
    """A pool with size classes serves from the blocks it pinned at open, waiting for pending
    transfers to give one back; only with nothing pending does it allocate (a counted pinning).
    Without classes it allocates while the budget has room, and waits when it has not.
    Without `wait`, a transfer still in flight is never waited for: the lease fails instead."""
    if not wait:
        pending.reap()
    while True:
        try:
            return pool.lease(nbytes, grow=False) if pool.classes else pool.lease(nbytes)
        except BudgetExceededError:
            if not wait and len(pending):
                raise
            if pending.wait_oldest():
                continue
            if not pool.classes:
                raise
        return pool.lease(nbytes)


def _check_nvme_path(path: Path) -> None:
    """Refuse a directory this process may not write, or make, reading metadata only (the
    disk's free space is `Sizing`'s check). Missing directories are made at `open()`, as the
    CLI's default RUN_DIR/nvme is: the nearest one that exists must be a writable directory."""
    where = path
    while not where.exists() and where.parent != where:  # a new directory is made in it
        where = where.parent
    if not where.is_dir():
        raise ConfigError(
            f"nvme path '{path}' is not usable: {where} is not a directory; choose "
            "another --nvme-path"
        )
    why = (
        "permission denied"
        if not os.access(where, os.W_OK | os.X_OK)
        # a filesystem of no blocks (proc, sysfs) holds no files, even for root
        else "not a filesystem for files"
        if os.statvfs(where).f_blocks == 0
        else None
    )
    if why is not None:
        raise ConfigError(
            f"nvme path '{path}' is not writable ({why}); choose a writable --nvme-path"
        )


def _probe_nvme_path(path: Path) -> None:
    """Create the directory and write and remove a file there: the proof `_check_nvme_path` can't
    give."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = (
            path / f".tierzero-write-probe-{os.getpid()}"
        )  # ranks sharing the path each write their own
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"nvme path '{path}' is not writable ({e.strerror}); choose a writable --nvme-path"
        ) from None
