"""Per-step counters: bytes moved per link (`planning.placement.Link`, whose values name the
metrics), param bytes the host cache served, time spent waiting on I/O, and the part of it
backward spent waiting for the pool to free a buffer while stepping units (back-pressure from
the optimizer's steps in flight: `wait_optimizer_s`), and each link's busy time
(`tierzero.engine.runtime.busy`: `busy_s/nvme->host`, ..., `busy_s/optimizer`)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from tierzero.engine.runtime.busy import OPTIMIZER, BusyLog
from tierzero.planning.placement import Link

BUSY_LINKS = (*(link.value for link in Link), OPTIMIZER)  # what `busy_s/` is logged for


class TransferStats:
    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.wait_s = 0.0
        self.optimizer_wait_s = 0.0  # of wait_s: backward blocked on the optimizer's buffers
        self._depth = 0  # nested waits count once
        self.busy = BusyLog()  # what each link spent working, fed where the work runs

    def add_bytes(self, link: Link, nbytes: int) -> None:
        self.bytes[link.value] += nbytes

    def nvme_busy(self, op: str, start: float, end: float) -> None:
        """An NVMe chunk's read or write interval (`NvmeStore.on_busy`), on its link."""
        link = Link.NVME_TO_HOST if op == "read" else Link.HOST_TO_NVME
        self.busy.add(link.value, start, end)

    def add_cache_hit(self, nbytes: int) -> None:
        """Param bytes copied to the device from the host pool's cache, not read from NVMe."""
        self.bytes["host_cache_hit"] += nbytes

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Time the training thread spends blocked on transfers (the outermost wait only)."""
        t0 = time.perf_counter()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.wait_s += time.perf_counter() - t0

    @contextmanager
    def backpressure(self) -> Iterator[None]:
        """Count the waits inside (a piece's buffers leased from backward) as `wait_optimizer_s`."""
        before = self.wait_s
        try:
            yield
        finally:
            self.optimizer_wait_s += self.wait_s - before

    def take(self) -> dict[str, float]:
        """The counters since the last call, as flat metrics (`bytes_nvme->host`, `io_wait_s`,
        `busy_s/nvme->host`: every link's, 0 where it did not work)."""
        out: dict[str, float] = {f"bytes_{k}": v for k, v in sorted(self.bytes.items())}
        out["io_wait_s"] = self.wait_s
        out["wait_optimizer_s"] = self.optimizer_wait_s
        busy = {**dict.fromkeys(BUSY_LINKS, 0.0), **self.busy.take()}  # an idle link: 0
        out.update({f"busy_s/{k}": v for k, v in sorted(busy.items())})
        self.bytes.clear()
        self.wait_s = self.optimizer_wait_s = 0.0
        return out
