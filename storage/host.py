"""The host tier: `HostPool` (pinned, page-aligned buffers under a budget) and `HostStore`.

Pinned memory makes host<->GPU copies run at full PCIe speed and asynchronously; page
alignment lets the NVMe store move bytes into these buffers with O_DIRECT.
"""

from __future__ import annotations

import torch

from tierzero.storage.memory import MemoryStore
from tierzero.storage.pool import BufferPool


class HostPool(BufferPool):
    """Host buffers under a byte budget; `pin=None` pins iff CUDA is available (decided at open)."""

    kind = "host"

    def __init__(self, budget_bytes: int, pin: bool | None = None, alignment: int = 4096) -> None:
        super().__init__(budget_bytes, alignment)
        self._pin_request = pin
        self.pin = bool(pin)

    def open(self) -> None:
        self.pin = torch.cuda.is_available() if self._pin_request is None else self._pin_request
        super().open()

    def _allocate(self, nbytes: int) -> torch.Tensor:
        # The CUDA host allocator rounds pinned blocks up to a power of two and caches them after
        # they are dropped; budgets count the requested capacity.
        return torch.empty(nbytes + self.alignment, dtype=torch.uint8, pin_memory=self.pin)


class HostStore(MemoryStore):
    """The host tier's store: shards in buffers leased from a `HostPool`."""

    tier = "host"
