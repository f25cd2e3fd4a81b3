"""The host tier: `HostPool` (pinned, page-aligned buffers under a budget) and `HostStore`.

Pinned memory makes host<->GPU copies run at full PCIe speed and asynchronously; page
alignment lets the NVMe store move bytes into these buffers with O_DIRECT.

Each block is its own anonymous mapping, pinned in place with `cudaHostRegister`, rather than a
`torch.empty(pin_memory=True)`: the CUDA caching host allocator rounds every block up to a power
of two and keeps freed blocks pinned for the life of the process, so real pinned memory could
reach twice the budget and never come back. A mapping is exactly the bytes the budget counts,
is unpinned when the pool drops it, and goes back to the OS with its last reference.
`pinned_empty` makes one such block outside any pool, unpinned when its last view dies.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Mapping

import numpy as np
import torch
from tierzero.storage.base import StorageError
from tierzero.storage.memory import MemoryStore
from tierzero.storage.pool import BufferPool

# cudaHostRegisterPortable: pinned for every CUDA context, as torch's own pin_memory_utils does.
_REGISTER_PORTABLE = 1


class HostPool(BufferPool):
    """Host buffers under a byte budget; `pin=None` pins iff CUDA is available (decided at open).

    `alignment` is raised to at least the page size: a block is a whole number of pages of real
    memory, so a smaller capacity would undercount the budget. Pinning is done in the context of
    `device` (a `cuda:k`; the engine always names it), whichever thread leases: the I/O loop's
    threads have cuda:0 current, and registering there would create a context on it.
    `registrations` counts `cudaHostRegister` calls (each a costly, synchronising driver call).
    Given size classes (`blocks`, see `BufferPool`), every block of the working set is pinned at
    `open()` and stays pinned until `close()`.
    A lease above every class gets a block of its own, pinned like the rest (counted): copies
    from pageable memory would not be asynchronous, and the engine sizes its classes to cover
    every size it leases, so these come only from other callers.
    """

    kind = "host"

    def __init__(
        self,
        budget_bytes: int,
        pin: bool | None = None,
        alignment: int = 4096,
        device: torch.device | str | None = None,
        blocks: Mapping[int, int] | None = None,
    ) -> None:
        super().__init__(budget_bytes, alignment, blocks)
        self.alignment = max(alignment, mmap.PAGESIZE)
        self._pin_request = pin
        self.pin = bool(pin)
        self.device = torch.device(device) if device is not None else None
        self.registrations = 0

    def open(self) -> None:
        cuda = torch.cuda.is_available()
        if self._pin_request and not cuda:
            raise StorageError(
                "pinned host memory needs CUDA, which is not available here; "
                "pass pin=None (pin when CUDA is there) or pin=False"
            )
        self.pin = cuda if self._pin_request is None else self._pin_request
        super().open()

    def _in_context(self) -> contextlib.AbstractContextManager:
        """The pinning device's context, made current on whichever thread pins."""
        return (
            torch.cuda.device(self.device) if self.device is not None else contextlib.nullcontext()
        )

    def _allocate(self, capacity: int) -> torch.Tensor:
        # Anonymous mappings are page-aligned; only an alignment above the page size needs slack.
        slack = self.alignment - mmap.PAGESIZE
        # The tensor references the mapping, which is unmapped when the last view of it dies;
        # never mmap.close() it: torch.frombuffer holds no buffer export, so close would succeed
        # and leave tensors callers still hold pointing at unmapped memory.
        try:
            # Private, like malloc's large blocks (shared anonymous memory would be shmem).
            region = mmap.mmap(-1, capacity + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            raise StorageError(
                f"cannot map {capacity} bytes of host memory ({exc.strerror}): "
                "lower the host budget"
            ) from exc
        raw = torch.frombuffer(region, dtype=torch.uint8)
        offset = -raw.data_ptr() % self.alignment
        data = raw[offset : offset + capacity]
        if self.pin:
            with self._in_context():
                _register(data.data_ptr(), capacity)
            self.registrations += 1
        return data

    def _release(self, data: torch.Tensor) -> None:
        # Unpin while the pool still holds the mapping: unregistering unmapped memory is an error,
        # and CPython's mmap unmaps before any weakref callback on it could run.
        if self.pin:
            with self._in_context():
                err = int(torch.cuda.cudart().cudaHostUnregister(data.data_ptr()))
            if err != 0:
                raise StorageError(
                    f"cannot unpin the {data.numel()}-byte host block at "
                    f"0x{data.data_ptr():x} (cudaHostUnregister error {err}; "
                    "it may be left over from an earlier CUDA call: rerun with "
                    "CUDA_LAUNCH_BLOCKING=1 to find it)"
                )


def _register(ptr: int, nbytes: int) -> None:
    """Pin `nbytes` at `ptr` for every CUDA context (the caller makes its device current)."""
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_PORTABLE))
    if err != 0:
        raise StorageError(
            f"cannot pin {nbytes} bytes of host memory (cudaHostRegister error {err}): "
            "lower the host budget, or raise the locked-memory limit (ulimit -l)"
        )


def _context(device: torch.device | None) -> contextlib.AbstractContextManager:
    """`device`'s CUDA context made current on the calling thread (pinning there, not on cuda:0)."""
    return (
        torch.cuda.device(device)
        if device is not None and device.type == "cuda"
        else contextlib.nullcontext()
    )


class _PinnedPages(np.ndarray):
    """A pinned mapping's bytes: unpinned in `__del__`, which runs while the array's base (the
    mapping) is still mapped -- a weakref callback on the mapping would run after the unmap."""

    pinned: tuple[int, torch.device | None] | None = None

    def __del__(self) -> None:
        if self.pinned is not None:
            ptr, device = self.pinned
            with _context(device):
                torch.cuda.cudart().cudaHostUnregister(ptr)  # nothing to report to from a finaliser


def pinned_empty(nbytes: int, device: torch.device | None = None) -> torch.Tensor:
    """`nbytes` of page-aligned host memory pinned in `device`'s context, outside torch's caching
    host allocator (which would round it up to a power of two and keep it pinned for the life of
    the process, see the module docstring): exactly the pages the budget counts, unpinned and
    unmapped when the last view of the tensor dies. The caller keeps it alive while a copy into or
    out of it can still run."""
    capacity = max(1, -(-nbytes // mmap.PAGESIZE)) * mmap.PAGESIZE
    region = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages = np.frombuffer(region, dtype=np.uint8).view(_PinnedPages)
    with _context(device):
        _register(pages.ctypes.data, capacity)
    pages.pinned = (pages.ctypes.data, device)
    return torch.from_numpy(pages)[:nbytes]  # the tensor holds `pages`, which holds the mapping


class HostStore(MemoryStore):
    """The host tier's store: shards in buffers leased from a `HostPool`."""

    tier = "host"
