"""`BufferPool`: a byte budget of aligned, reusable buffers with an LRU shard cache.

The pool owns every buffer it hands out. `lease(nbytes)` returns a 1-D uint8 tensor of exactly
`nbytes` whose data pointer is `alignment`-aligned, cut from a block whose capacity is `nbytes`
rounded up to `alignment` -- or, for a pool given size classes (`blocks`, see
`tierzero.storage.sizeclass`), up to the smallest class that holds it. Given-back blocks are kept
on free lists keyed by capacity and reused as-is, because touching fresh memory is slow (a new
multi-GB allocation halves copy speed until its pages are faulted in) and, for pinned host
memory, allocating one is a synchronising driver call.

Size classes: `blocks` maps each class capacity to how many blocks of it to allocate at
`open()`, the working set its owner's memory model predicts. After that a lease takes a free
block of its class, never a larger class's (it would starve that class); `lease(grow=False)`
stops there and raises `BudgetExceededError`, so a caller with transfers in flight waits for one
of them to give a block back rather than allocating. Growing under budget pressure evicts a
cached block of the lease's class first (reused as it is), before dropping other blocks. A size
above every class (one the owner did not size the pool for) gets a block of its own aligned
size, allocated when first leased and reused after.

Budget accounting: `resident_bytes` is the capacity of every block the pool holds -- leased,
cached, or idle on a free list. It never exceeds `budget_bytes`. When a new block would not fit,
the pool first drops idle free blocks, then evicts cache entries (least recently used first,
never one that is leased), and only then raises `BudgetExceededError`. Eviction and `cache_drop`
put a block back on its free list; only this budget pressure, a lower budget (`set_budget`) and
`close()` drop blocks (and run `_release`; the first two then call `dropped`, a hook for a
watcher). An allocation that is not already aligned carries a few bytes of slack to align it
(< `alignment` per block), not counted.

The cache maps a shard key to a block: `cache_put(key, buf)` registers a leased buffer,
`cache_get(key)` leases it again (every lease and every hit is paired with one `give_back`), and
a cached block whose leases are all given back stays resident until evicted or dropped.
Subclasses say how to allocate (`HostPool`: page-aligned host mappings, pinned when CUDA is
there; `DevicePool`: GPU memory) and, where a block holds more than its bytes (a pinning), how to
release it: `_release` runs once per block the pool drops -- evicted, trimmed, or at `close()` --
while the pool still holds the block, so the memory is still mapped when it runs.
All methods are thread-safe: the training thread and the I/O loop both lease.

Contract: give a buffer back only once every asynchronous copy from or into it has finished
(the swap runner waits on the copy's event first), or with `ready`: an opaque token (a stream
event) that the next holder must wait for before writing the block -- the device pool's blocks
go back while compute kernels queued on the GPU may still read them, and the next copy into one
waits for exactly that release. The pool keeps the token, never interprets it, and may reuse,
unpin or drop a given-back block at once.
"""

from __future__ import annotations

import abc
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from tierzero.storage.base import BudgetExceededError, StorageError
from tierzero.storage.sizeclass import class_for


@dataclass(eq=False)
class _Block:
    """One allocation: its aligned bytes, the length of the current lease, and who holds it."""

    data: torch.Tensor  # 1-D uint8, `capacity` bytes, aligned
    nbytes: int = 0
    leases: int = 0
    cache_key: str | None = None
    ready: object | None = None  # what the last holder said must happen before the next write

    @property
    def capacity(self) -> int:
        return self.data.numel()

    def view(self) -> torch.Tensor:
        return self.data[: self.nbytes]


class BufferPool(abc.ABC):
    """Aligned buffers under a byte budget; see the module docstring for the accounting."""

    kind: str  # "host" or "device", for messages

    def __init__(
        self, budget_bytes: int, alignment: int = 4096, blocks: Mapping[int, int] | None = None
    ) -> None:
        if budget_bytes <= 0:
            raise StorageError(
                f"{self.kind} pool budget_bytes must be positive, got {budget_bytes}"
            )
        if alignment <= 0 or alignment & (alignment - 1):
            raise StorageError(
                f"{self.kind} pool alignment must be a power of two, got {alignment}"
            )
        self._budget_bytes = budget_bytes
        self.alignment = alignment
        self._lock = threading.Lock()
        self._blocks: dict[int, _Block] = {}  # data_ptr -> block, every block held
        self._free: dict[int, list[_Block]] = {}  # capacity -> idle blocks
        self._cache: OrderedDict[str, _Block] = OrderedDict()  # LRU first
        self._resident_bytes = 0
        self._peak_bytes = 0
        self._is_open = False
        self._unreleased: list[_Block] = []  # blocks whose release failed: never freed
        self._provision = dict(blocks or {})  # class capacity -> blocks allocated at open
        self.classes = tuple(sorted(self._provision))

    @abc.abstractmethod
    def _allocate(self, capacity: int) -> torch.Tensor:
        """A fresh 1-D uint8 tensor to cut an aligned block of `capacity` bytes from.

        Either exactly `capacity` bytes that are already `alignment`-aligned (taken whole), or
        at least `capacity` + `alignment` bytes (the pool slices an aligned run out of it).
        """

    def _release(self, data: torch.Tensor) -> None:
        """Undo what `_allocate` did beyond the bytes (nothing by default); once per block.

        Called while the pool still references `data`. Tensors callers still hold keep the
        memory itself alive, so this must never free it, only what came with it.
        """
        return None

    def open(self) -> None:
        """Allocate the size classes' blocks (`blocks`), idle on their free lists; on a failure
        release the ones allocated so far and raise."""
        bad = [c for c in self.classes if c % self.alignment]
        if bad:
            raise StorageError(
                f"{self.kind} pool classes {bad} are not multiples of its alignment "
                f"{self.alignment}"
            )
        self._is_open = True
        try:
            self.provision(self._provision)
        except BaseException:
            self.close()
            raise

    def provision(self, blocks: Mapping[int, int]) -> None:
        """Allocate `blocks` (class capacity -> how many) more blocks, idle on their free lists."""
        with self._lock:
            for capacity, n in sorted(blocks.items()):
                if capacity not in self.classes:
                    raise StorageError(
                        f"{capacity} is not one of the {self.kind} pool's classes {self.classes}"
                    )
                for _ in range(n):
                    self._free.setdefault(capacity, []).append(self._new_block(capacity, capacity))

    def close(self) -> None:
        """Release and forget every block; tensors callers still hold stay valid memory, but
        uncounted and no longer pinned.

        Every block is released even when one release fails; the first failure is raised after.
        """
        with self._lock:
            blocks = list(self._blocks.values())
            self._blocks.clear()
            self._free.clear()
            self._cache.clear()
            self._resident_bytes = 0
            self._is_open = False
            failure: Exception | None = None
            for block in blocks:
                try:
                    self._release_block(block)
                except Exception as exc:  # noqa: BLE001 - release the rest, raise the first
                    failure = failure or exc
            if failure is not None:
                raise failure

    def __enter__(self) -> BufferPool:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        return self._is_open

    @property
    def budget_bytes(self) -> int:
        return self._budget_bytes

    @property
    def resident_bytes(self) -> int:
        return self._resident_bytes

    @property
    def peak_bytes(self) -> int:
        return self._peak_bytes

    @property
    def block_capacities(self) -> dict[int, int]:
        """How many blocks of each capacity the pool holds (leased, cached or idle)."""
        with self._lock:
            counts: dict[int, int] = {}
            for block in self._blocks.values():
                counts[block.capacity] = counts.get(block.capacity, 0) + 1
            return counts

    @property
    def leased_bytes(self) -> int:
        with self._lock:
            return sum(b.capacity for b in self._blocks.values() if b.leases)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b.capacity for b in self._cache.values())

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget. A lower one is met at once by dropping idle blocks and evicting
        cached ones (least recently used first); if leased blocks alone exceed it, nothing
        changes and `BudgetExceededError` says by how much."""
        if budget_bytes <= 0:
            raise StorageError(
                f"{self.kind} pool budget_bytes must be positive, got {budget_bytes}"
            )
        with self._lock:
            leased = sum(b.capacity for b in self._blocks.values() if b.leases)
            if leased > budget_bytes:
                raise BudgetExceededError(
                    f"{self.kind} pool cannot shrink to {budget_bytes} bytes: "
                    f"{leased} bytes are leased"
                )
            self._budget_bytes = budget_bytes
            for size in list(self._free):
                while self._free[size] and self._resident_bytes > budget_bytes:
                    self._drop(self._free[size].pop())
            for key in list(self._cache):
                if self._resident_bytes <= budget_bytes:
                    break
                block = self._cache[key]
                if not block.leases:
                    del self._cache[key]
                    block.cache_key = None
                    self._drop(block)

    def reset_peak(self) -> None:
        with self._lock:
            self._peak_bytes = self._resident_bytes

    def lease(self, nbytes: int, grow: bool = True) -> torch.Tensor:
        """A 1-D uint8 tensor of exactly `nbytes`, aligned; pair it with one `give_back`.
        `grow=False`: only a block the pool holds idle, else `BudgetExceededError`."""
        if nbytes < 0:
            raise StorageError(f"cannot lease {nbytes} bytes from the {self.kind} pool")
        capacity = class_for(nbytes, self.classes, self.alignment)
        with self._lock:
            if not self._is_open:
                raise StorageError(f"the {self.kind} pool is not open: call open() first")
            block = self._reuse(capacity)
            if block is None and not grow:
                raise BudgetExceededError(f"no idle {self.kind} block of {capacity} bytes")
            block = block or self._new_block(capacity, nbytes)
            block.nbytes = nbytes
            block.leases = 1
            return block.view()

    def give_back(self, buf: torch.Tensor, ready: object | None = None) -> None:
        """Return one lease of `buf`; an uncached block goes to the free list for reuse.
        `ready`: what its next holder must wait for before writing it (see `take_ready`)."""
        with self._lock:
            block = self._blocks.get(buf.data_ptr())
            if block is None or block.leases == 0:
                raise StorageError(
                    f"buffer at 0x{buf.data_ptr():x} is not leased from this "
                    f"{self.kind} pool: give back the tensor lease() returned, once"
                )
            block.leases -= 1
            block.ready = ready
            if block.leases == 0 and block.cache_key is None:
                self._free.setdefault(block.capacity, []).append(block)

    def take_ready(self, buf: torch.Tensor) -> object | None:
        """The token the leased `buf`'s last holder gave back with (None for a fresh block, or
        one given back without); taken, so it is waited for once."""
        with self._lock:
            block = self._blocks.get(buf.data_ptr())
            if block is None or block.leases == 0:
                raise StorageError(
                    f"buffer at 0x{buf.data_ptr():x} is not leased from this "
                    f"{self.kind} pool: ask for the tensor lease() returned"
                )
            ready, block.ready = block.ready, None
            return ready

    def cache_put(self, key: str, buf: torch.Tensor) -> None:
        """Keep the leased `buf` under `key` after its leases are given back (replaces `key`)."""
        with self._lock:
            block = self._blocks.get(buf.data_ptr())
            if block is None or block.leases == 0:
                raise StorageError(
                    f"cannot cache {key!r}: the buffer is not leased from this "
                    f"{self.kind} pool; cache a buffer from lease()"
                )
            if block.cache_key is not None:
                self._uncache(block.cache_key)
            if key in self._cache:
                self._uncache(key)
            block.cache_key = key
            self._cache[key] = block

    def cache_get(self, key: str) -> torch.Tensor | None:
        """The cached buffer under `key`, leased again (give it back), or None on a miss."""
        with self._lock:
            block = self._cache.get(key)
            if block is None:
                return None
            self._cache.move_to_end(key)
            block.leases += 1
            return block.view()

    def cache_drop(self, key: str) -> None:
        """Forget `key`; its block is reused once its leases are given back. Missing: no-op."""
        with self._lock:
            if key in self._cache:
                self._uncache(key)

    def _uncache(self, key: str) -> None:
        block = self._cache.pop(key)
        block.cache_key = None
        if block.leases == 0:
            self._free.setdefault(block.capacity, []).append(block)

    def _reuse(self, capacity: int) -> _Block | None:
        """An idle block of `capacity`; never a larger one (a small lease holding a large block
        would starve that class)."""
        free = self._free.get(capacity)
        return free.pop() if free else None

    def _new_block(self, capacity: int, nbytes: int) -> _Block:
        if capacity > self._budget_bytes:
            raise self._over_budget(nbytes)
        if self.classes and self._resident_bytes + capacity > self._budget_bytes:
            # with size classes, a cached block of this class serves as it is (an idle block of
            # another class would be dropped now and allocated again when its class needs it)
            key = next(
                (k for k, b in self._cache.items() if b.capacity == capacity and not b.leases), None
            )
            if key is not None:
                block = self._cache.pop(key)
                block.cache_key = None
                return block
        # Idle free blocks are pure waste under pressure; cached shards are worth keeping longer.
        for size in sorted(self._free, reverse=True):
            while self._free[size] and self._resident_bytes + capacity > self._budget_bytes:
                self._drop(self._free[size].pop())
        for key in list(self._cache):
            if self._resident_bytes + capacity <= self._budget_bytes:
                break
            block = self._cache[key]
            if block.leases:
                continue
            del self._cache[key]
            block.cache_key = None
            if block.capacity == capacity:
                return block
            self._drop(block)
        if self._resident_bytes + capacity > self._budget_bytes:
            raise self._over_budget(nbytes)
        raw = self._allocate(capacity)
        offset = -raw.data_ptr() % self.alignment
        block = _Block(raw[offset : offset + capacity])
        assert block.capacity == capacity, "_allocate returned too few bytes to align"
        self._blocks[block.data.data_ptr()] = block
        self._resident_bytes += capacity
        self._peak_bytes = max(self._peak_bytes, self._resident_bytes)
        return block

    def _drop(self, block: _Block) -> None:
        del self._blocks[block.data.data_ptr()]
        self._resident_bytes -= block.capacity
        self._release_block(block)
        self.dropped(block.data)

    def dropped(self, data: torch.Tensor) -> None:
        """Told, under the pool's lock, of each block dropped while the pool is open (budget
        pressure, a lower budget; not `close()`): the next block at that address is fresh memory
        with no release token. Nothing by default; a watcher of the tokens hooks in here."""
        return None

    def _release_block(self, block: _Block) -> None:
        """`_release` while `block` still holds the memory; a block whose release failed (left
        pinned, say) is kept referenced for good, so its memory is never unmapped under it."""
        try:
            self._release(block.data)
        except BaseException:
            self._unreleased.append(block)
            raise

    def _over_budget(self, nbytes: int) -> BudgetExceededError:
        leased = sum(b.capacity for b in self._blocks.values() if b.leases)
        return BudgetExceededError(
            f"{self.kind} pool cannot lease {nbytes} bytes: budget {self._budget_bytes}, "
            f"{leased} bytes leased and not given back. Raise the {self.kind} budget, use "
            f"smaller shards, or give buffers back sooner"
        )
