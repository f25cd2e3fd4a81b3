"""A fake CUDA runtime that records pinning, and a recorder of the host pool's mappings.

Shared by the host pool's own tests and the engine's host-block tests, so pinning is checked
without a GPU while the mappings themselves stay real.
"""

from __future__ import annotations

import gc
import mmap
import weakref
from collections.abc import Iterator

import pytest
import torch

PAGE = mmap.PAGESIZE
_MMAP = mmap.mmap


class Mappings:
    """Every anonymous mapping HostPool makes, by weak reference, with its address range."""

    def __init__(self) -> None:
        self.refs: list[tuple[int, int, weakref.ref]] = []  # (address, length, mapping)

    def record(self, m: mmap.mmap) -> None:
        address = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
        self.refs.append((address, len(m), weakref.ref(m)))

    def holding(self, ptr: int) -> mmap.mmap | None:
        """The live, open mapping that contains `ptr`, if any."""
        for address, length, ref in self.refs:
            m = ref()
            if address <= ptr < address + length and m is not None and not m.closed:
                return m
        return None

    def live(self) -> int:
        gc.collect()
        return sum(ref() is not None for _, _, ref in self.refs)


@pytest.fixture
def mappings(monkeypatch: pytest.MonkeyPatch) -> Mappings:
    recorded = Mappings()

    class RecordedMmap(_MMAP):
        def __new__(cls, *args: object, **kwargs: object) -> RecordedMmap:
            m = super().__new__(cls, *args, **kwargs)
            recorded.record(m)
            return m

    monkeypatch.setattr(mmap, "mmap", RecordedMmap)
    return recorded


class FakeCudart:
    """Records pinning; refuses to unpin twice, unpin what was never pinned, or unmapped memory."""

    def __init__(self, mappings: Mappings, fail_with: int = 0, fail_unpin_with: int = 0) -> None:
        self.mappings = mappings
        self.fail_with = fail_with
        self.fail_unpin_with = fail_unpin_with
        self.pinned: dict[int, int] = {}  # ptr -> nbytes, pinned now
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        self.peak_pinned_bytes = 0

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        if self.fail_with:
            return self.fail_with
        assert ptr % PAGE == 0 and self.mappings.holding(ptr) is not None
        assert ptr not in self.pinned
        self.pinned[ptr] = nbytes
        self.registered.append(ptr)
        self.peak_pinned_bytes = max(self.peak_pinned_bytes, sum(self.pinned.values()))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        if self.fail_unpin_with:
            return self.fail_unpin_with
        assert ptr in self.pinned, "unpinned twice, or never pinned"
        assert self.mappings.holding(ptr) is not None, "unpinned after the memory was unmapped"
        del self.pinned[ptr]
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch, mappings: Mappings) -> Iterator[FakeCudart]:
    fake = FakeCudart(mappings)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    yield fake
