"""The GPU tier: `DevicePool` (device memory under a budget) and `DeviceStore`.

On a CPU-only machine `device="cpu"` runs the same code on host memory, so tests cover it.
"""

from __future__ import annotations

import torch
from tierzero.storage.memory import MemoryStore
from tierzero.storage.pool import BufferPool

DEVICE_ALIGNMENT = 256  # bytes every device-pool lease is aligned to (and rounded up to)


class DevicePool(BufferPool):
    """Buffers on `device` under a byte budget.

    A bare `cuda` is bound to the current device at open: the I/O loop's threads lease too, and
    theirs is cuda:0 whatever GPU this process trains on.
    """

    kind = "device"

    def __init__(
        self, budget_bytes: int, device: torch.device | str, alignment: int = DEVICE_ALIGNMENT
    ) -> None:
        super().__init__(budget_bytes, alignment)
        self.device = torch.device(device)

    def open(self) -> None:
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        super().open()

    def _allocate(self, capacity: int) -> torch.Tensor:
        return torch.empty(capacity + self.alignment, dtype=torch.uint8, device=self.device)


class DeviceStore(MemoryStore):
    """The GPU tier's store: shards in buffers leased from a `DevicePool`."""

    tier = "gpu"
