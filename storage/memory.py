"""`MemoryStore`: a `TierStore` whose shards live in buffers leased from a `BufferPool`.

The host and GPU tiers are the same store over different pools; the pool enforces the budget.
A shard's buffer is given back when the shard is overwritten or deleted -- but only after every
read copying out of it has finished, so a concurrent write never recycles bytes being read.
Copies run on the I/O loop's threads (they release the GIL); an awaited write or read is
complete. The engine, which owns the streams, uses `view()` when it wants stream-ordered copies
of its own.

On a GPU a copy runs on the stream the store is handed (the engine's `Streams.store_copy`; a store
built without one makes its own on the first copy that needs it) and the thread waits for that
copy's event only, never for a whole stream (a blocking `copy_` between host and device would
synchronise the thread's current stream, where the training thread's compute is queued). What the
copy waits for on the device: a fresh buffer's release (the token its last holder gave it back with,
see `BufferPool`), and -- when it reads device memory, which compute may be writing in place through
`view()` -- the work queued on the stream the caller is given: the calling thread's current stream
when it calls `write`/`read_into` (an event recorded there and then, so a caller that computes on a
stream of its own is followed, not the device's default stream). The coroutine runs later on an I/O
thread, whose current stream is not the caller's. A write of host bytes into a fresh buffer waits
for nothing of compute's.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tierzero.storage.base import (
    Capabilities,
    ShardNotFoundError,
    StorageError,
    TierStore,
    check_flat,
    check_key,
    check_out,
    dtype_name,
)
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


def _issued_before(src: torch.Tensor) -> object | None:
    """Where `src` is device memory: an event after everything the calling thread's current
    stream has queued so far (compute that may still write `src`); None otherwise."""
    if not src.is_cuda:
        return None
    with torch.cuda.device(src.device):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(src.device))
    return event


def _copy(
    dst: torch.Tensor,
    src: torch.Tensor,
    stream_for: Callable[[torch.device], torch.cuda.Stream],
    *ready: object | None,
) -> None:
    """`dst.copy_(src)`, finished on return. On a GPU: on `stream_for(device)`, after every event
    in `ready` (CUDA events or None): a buffer's release, the source's producer."""
    device = dst.device if dst.is_cuda else src.device if src.is_cuda else None
    if device is None:  # host to host: numpy's copy, one thread, not an OpenMP team per I/O worker
        if dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous():
            np.copyto(_bytes(dst), _bytes(src))
        else:
            dst.copy_(src)
        return
    with torch.cuda.device(device):  # this I/O thread's current device may be another GPU
        stream = stream_for(device)
        for event in ready:
            if isinstance(event, torch.cuda.Event):
                stream.wait_event(event)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
        done.synchronize()  # host sync point: this copy's event only


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


async def _copy_then(
    dst: torch.Tensor,
    src: torch.Tensor,
    then: Callable[[bool], None],
    stream_for: Callable[[torch.device], torch.cuda.Stream],
    *ready: object | None,
) -> None:
    """Copy on an I/O thread; `then(ok)` runs once the thread is done with both buffers, even
    if the awaiting task was cancelled meanwhile (the thread cannot be stopped mid-copy)."""
    fut = asyncio.get_running_loop().run_in_executor(None, _copy, dst, src, stream_for, *ready)
    fut.add_done_callback(lambda f: then(not f.cancelled() and f.exception() is None))
    await asyncio.shield(fut)


class MemoryStore(TierStore):
    """Shards resident in a pool's buffers; zero-copy `view(key)`. `stream`: where copies that
    touch a GPU run (see the module docstring)."""

    def __init__(self, pool: BufferPool, stream: torch.cuda.Stream | None = None) -> None:
        self.pool = pool
        self.stream = stream
        self._stream_lock = threading.Lock()
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

    def write(self, key: str, src: torch.Tensor) -> Coroutine[Any, Any, None]:
        """Store `src` under `key`, ordered after the calling thread's current stream (above)."""
        return self._write(key, src, _issued_before(src))

    async def _write(self, key: str, src: torch.Tensor, produced: object | None) -> None:
        check_key(key)
        check_flat(src, "src", key)
        dtype_name(src.dtype)
        buf = self.pool.lease(src.numel() * src.element_size())
        shard = _Resident(buf, src.dtype, src.numel())
        await _copy_then(
            shard.typed(),
            src,
            lambda ok: self._install(key, shard, ok),
            self._stream_for,
            self.pool.take_ready(buf),
            produced,
        )

    def read_into(
        self, key: str, out: torch.Tensor, verify: bool = False
    ) -> Coroutine[Any, Any, None]:
        """Copy `key`'s shard into `out`; ordered after the calling thread's current stream when
        the shard is device memory (see above)."""
        shard = self._shards.get(key)
        return self._read_into(key, out, _issued_before(shard.buf) if shard is not None else None)

    async def _read_into(self, key: str, out: torch.Tensor, produced: object | None) -> None:
        shard = self._get(key)
        check_out(key, out, shard.dtype, shard.numel)
        shard.readers += 1
        await _copy_then(
            out, shard.typed(), lambda ok: self._release_reader(shard), self._stream_for, produced
        )

    async def exists(self, key: str) -> bool:
        return check_key(key) in self._shards

    async def delete(self, key: str) -> None:
        shard = self._shards.pop(check_key(key), None)
        if shard is not None:
            self._retire(shard)

    async def flush(self) -> None:
        """Nothing to do: memory tiers are not durable."""

    def _stream_for(self, device: torch.device) -> torch.cuda.Stream:
        """The stream copies on `device` run on: the one handed in, else one made on first use."""
        with self._stream_lock:
            if self.stream is None:
                self.stream = torch.cuda.Stream(device)
            return self.stream

    def _get(self, key: str) -> _Resident:
        shard = self._shards.get(check_key(key))
        if shard is None:
            raise ShardNotFoundError(
                f"no shard {key!r} in the {self.tier} store: write it before reading it"
            )
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
