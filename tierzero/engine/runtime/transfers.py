"""Per-step counters: bytes moved per link (`planning.placement.Link`, whose values name the
metrics), param bytes the host cache served, time spent waiting on I/O."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from tierzero.planning.placement import Link


class TransferStats:
    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.wait_s = 0.0
        self._depth = 0  # nested waits count once

    def add_bytes(self, link: Link, nbytes: int) -> None:
        self.bytes[link.value] += nbytes

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

    def take(self) -> dict[str, float]:
        """The counters since the last call, as flat metrics (`bytes_nvme->host`, `io_wait_s`)."""
        out: dict[str, float] = {f"bytes_{k}": v for k, v in sorted(self.bytes.items())}
        out["io_wait_s"] = self.wait_s
        self.bytes.clear()
        self.wait_s = 0.0
        return out
