"""`MemoryStore`: a `TierStore` whose shards live in buffers leased from a `BufferPool`.

The host and GPU tiers are the same store over different pools; the pool enforces the budget.
A shard's buffer is given back when the shard is overwritten or deleted -- but only after every
read copying out of it has finished, so a concurrent write never recycles bytes being read.
Copies run on the I/O loop's threads (they release the GIL) and wait for the GPU when one is
involved, so an awaited write or read is complete; the engine, which owns the streams, uses
`view()` when it wants stream-ordered copies of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierzero.storage.base import (Capabilities, ShardNotFoundError, StorageError, TierStore,
                                   check_flat, check_key, check_out, dtype_name)
from tierzero.storage.pool import BufferPool


@dataclass(eq=False)
class _Resident:
    """One shard held in a leased buffer, and the reads still copying out of it."""

    buf: torch.Tensor  # uint8, exactly the shard's bytes
    dtype: torch.dtype
    numel: int
    readers: int = 0
    retired: bool = False

    def typed(self) -> torch.Tensor:
        return self.buf.view(self.dtype)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)
    for t in (dst, src):
        if t.is_cuda:  # host-device sync point: the awaited copy must be finished
            torch.cuda.current_stream(t.device).synchronize()


async def _copy_then(dst: torch.Tensor, src: torch.Tensor, then: Callable[[bool], None]) -> None:
    """Copy on an I/O thread; `then(ok)` runs once the thread is done with both buffers, even
    if the awaiting task was cancelled meanwhile (the thread cannot be stopped mid-copy)."""
    fut = asyncio.get_running_loop().run_in_executor(None, _copy, dst, src)
    fut.add_done_callback(lambda f: then(not f.cancelled() and f.exception() is None))
    await asyncio.shield(fut)


class MemoryStore(TierStore):
    """Shards resident in a pool's buffers; zero-copy `view(key)`."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self._shards: dict[str, _Resident] = {}

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(persistent=False, direct_io=False, zero_copy=True)

    def open(self) -> None:
        if not self.pool.is_open:
            raise StorageError(f"the {self.tier} store's pool is not open: open the pool first")

    def close(self) -> None:
        for key in list(self._shards):
            self._retire(self._shards.pop(key))

    def view(self, key: str) -> torch.Tensor:
        """The resident tensor itself; valid until `key` is next written or deleted."""
        return self._get(key).typed()

    async def write(self, key: str, src: torch.Tensor) -> None:
        check_key(key)
        check_flat(src, "src", key)
        dtype_name(src.dtype)
        buf = self.pool.lease(src.numel() * src.element_size())
        shard = _Resident(buf, src.dtype, src.numel())
        await _copy_then(shard.typed(), src, lambda ok: self._install(key, shard, ok))

    async def read_into(self, key: str, out: torch.Tensor, verify: bool = False) -> None:
        shard = self._get(key)
        check_out(key, out, shard.dtype, shard.numel)
        shard.readers += 1
        await _copy_then(out, shard.typed(), lambda ok: self._release_reader(shard))

    async def exists(self, key: str) -> bool:
        return check_key(key) in self._shards

    async def delete(self, key: str) -> None:
        shard = self._shards.pop(check_key(key), None)
        if shard is not None:
            self._retire(shard)

    async def flush(self) -> None:
        """Nothing to do: memory tiers are not durable."""

    def _get(self, key: str) -> _Resident:
        shard = self._shards.get(check_key(key))
        if shard is None:
            raise ShardNotFoundError(f"no shard {key!r} in the {self.tier} store: write it "
                                     f"before reading it")
        return shard

    def _install(self, key: str, shard: _Resident, ok: bool) -> None:
        if not ok:
            self.pool.give_back(shard.buf)
            return
        old = self._shards.get(key)
        self._shards[key] = shard
        if old is not None:
            self._retire(old)

    def _release_reader(self, shard: _Resident) -> None:
        shard.readers -= 1
        if shard.retired and not shard.readers:
            self.pool.give_back(shard.buf)

    def _retire(self, shard: _Resident) -> None:
        shard.retired = True
        if not shard.readers:
            self.pool.give_back(shard.buf)
