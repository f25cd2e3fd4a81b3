"""Raw direct I/O, timed: the ceiling `DiskBench` compares the store with, and the page-cache
eviction its buffered reads need.

`time_raw` writes or reads one buffer as `RAW_BLOCK_BYTES` blocks, all in flight at once on
the I/O loop's threads (the pool the store uses), with O_DIRECT where the caller found it
works; a buffered write is timed up to its fdatasync, a buffered read starts from a file
evicted from the page cache (`drop_cache`). It owns no files: the caller names the path.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from tierzero.storage.io import IOLoop

RAW_BLOCK_BYTES = 8 << 20


def time_raw(
    io_loop: IOLoop, data: memoryview, nbytes: int, path: str, rw: str, direct: bool
) -> float:
    """Seconds to write (`rw="write"`) `data[:nbytes]` to `path`, or read it back into `data`."""
    blocks = [(off, data[off : off + RAW_BLOCK_BYTES]) for off in range(0, nbytes, RAW_BLOCK_BYTES)]
    flags = os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    if rw == "write":
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)

        def job(off: int, b: memoryview) -> Any:
            return os.pwrite(fd, b, off)
    else:
        if not direct:
            drop_cache(path)
        fd = os.open(path, os.O_RDONLY | flags)

        def job(off: int, b: memoryview) -> Any:
            return os.preadv(fd, [b], off)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, job, off, b) for off, b in blocks))
        if rw == "write" and not direct:
            await loop.run_in_executor(None, os.fdatasync, fd)

    try:
        start = time.perf_counter()
        io_loop.run(run())
        return time.perf_counter() - start
    finally:
        os.close(fd)


def drop_cache(path: str) -> None:
    """Write back and evict `path` from the page cache, so the next read comes from the drive."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
