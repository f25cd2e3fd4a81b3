"""One chunk file on disk: the blocking reads, writes and fsyncs the NVMe store runs on I/O threads.

Bytes move with `os.pwrite` / `os.preadv` straight between the file and the caller's buffer (a
memoryview over the tensor's storage): no Python `bytes` objects, no copies. With O_DIRECT the
page cache is bypassed, which needs the buffer address, the file offset and the length to be
multiples of `ALIGN` (4 KiB covers every logical block size in use). A chunk file is always
`chunk_bytes` long (zarr pads the last chunk to full size), so only a shard's final partial page
goes through a small aligned bounce page; a caller buffer that is not aligned at all falls back
to buffered I/O. This module never names arrays or keys: callers turn its errors into domain
errors.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import time

import crc32c
import numpy as np
from tierzero.storage.durable import fsync_path

ALIGN = 4096


def _load_syncfs():  # type: ignore[no-untyped-def]
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs  # releases the GIL per call
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


# The C library's syncfs(2) and renameat2(2), or None where it lacks them: system calls beside
# os's, which a test that records or kills at the system calls wraps as it wraps `os.fsync`.
syncfs = _load_syncfs()


def _load_renameat2():  # type: ignore[no-untyped-def]
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


renameat2 = _load_renameat2()
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
# Filesystems in RAM: O_DIRECT there (accepted by recent kernels) is still a memory copy.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


class ShortChunkError(Exception):
    """A chunk file is shorter than its recorded size (truncated)."""


def is_aligned(address: int, nbytes: int = 0) -> bool:
    return address % ALIGN == 0 and nbytes % ALIGN == 0


def _bounce_page() -> memoryview:
    raw = np.zeros(2 * ALIGN, dtype=np.uint8)
    offset = -raw.ctypes.data % ALIGN
    return memoryview(raw[offset : offset + ALIGN])


def _flags(direct: bool) -> int:
    return os.O_CLOEXEC | (os.O_DIRECT if direct else 0)


def probe_direct(directory: str) -> bool:
    """Whether `directory`'s filesystem accepts O_DIRECT writes (tmpfs, for one, does not)."""
    path = os.path.join(directory, f".direct-probe.{os.getpid()}-0.tmp")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _flags(True), 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        os.pwrite(fd, _bounce_page(), 0)
        return True
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        os.unlink(path)


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding `path` (the longest mount point above it in
    /proc/self/mounts), or "unknown" where that cannot be read."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, parts[2]
    except OSError:
        pass
    return kind


def write_chunk(path: str, data: memoryview, chunk_bytes: int, direct: bool) -> None:
    """Make `path` (new, or a spare whose blocks get overwritten in place) hold `data`
    zero-padded to exactly `chunk_bytes`. `direct` requires `data` to start at an aligned
    address (its length may end mid-page)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | _flags(direct), 0o644)
    try:
        body = len(data) - len(data) % ALIGN if direct else len(data)
        _pwrite_all(fd, data[:body], 0)
        end = body
        if body < len(data):
            page = _bounce_page()
            page[: len(data) - body] = data[body:]
            _pwrite_all(fd, page, body)
            end += ALIGN
        if end < chunk_bytes or os.fstat(fd).st_size != chunk_bytes:
            # Cut whatever a spare held past the data, then pad with a hole: zeros, zarr's fill.
            os.ftruncate(fd, end)
            os.ftruncate(fd, chunk_bytes)
    finally:
        os.close(fd)


def read_chunk(path: str, out: memoryview, chunk_bytes: int, direct: bool) -> None:
    """Fill `out` from the start of the chunk file `path`; a file that is not `chunk_bytes`
    long raises `ShortChunkError`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _flags(direct))  # a FIFO must not block
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, "is not a regular file (a FIFO, device or socket)", path)
        size = found.st_size
        if size != chunk_bytes:
            raise ShortChunkError(f"{size} bytes instead of {chunk_bytes}")
        body = len(out) - len(out) % ALIGN if direct else len(out)
        _preadv_all(fd, out[:body], 0)
        if body < len(out):
            page = _bounce_page()
            _preadv_all(fd, page, body)
            out[body:] = page[: len(out) - body]
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n == 0:  # no progress and no error: the device is failing; never spin
            raise OSError(errno.EIO, "pwrite wrote 0 bytes")
        done += n


def _preadv_all(fd: int, out: memoryview, offset: int) -> None:
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            raise ShortChunkError(f"ends at byte {offset + done}")
        done += n


def exchange(a: str, b: str) -> bool:
    """Swap two existing paths in one atomic step (Linux `renameat2` with RENAME_EXCHANGE): True
    once done, False where the C library or the filesystem cannot (the caller falls back)."""
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


def sync_filesystem(path: str) -> None:
    """Flush the filesystem holding `path`: syncfs (one call for data, new files and renames),
    else fsync every file and directory below it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if syncfs is not None:
            if syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), path)
            return
    finally:
        os.close(fd)
    for dirpath, _, names in os.walk(path):
        for name in names:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


# `verify_reads="auto"` verifies every read when crc32c runs at this many times the speed one
# thread reads the store: then checking a read costs at most 1/20 (5%) of the read itself, so of
# a step however I/O-bound (benchmarks/verify_cost.py measures the real share).
CHEAP_CRC_RATIO = 20


def verify_is_cheap(directory: str, chunk_bytes: int, direct: bool) -> bool:
    """Whether crc32c outruns one thread's reads of `directory` `CHEAP_CRC_RATIO` times over."""
    return crc32c_rate() >= CHEAP_CRC_RATIO * read_rate(directory, chunk_bytes, direct)


def crc32c_rate(nbytes: int = 8 << 20) -> float:
    """Bytes per second crc32c checks on this CPU (best of 3 over an `nbytes` buffer)."""
    buffer = memoryview(np.ones(nbytes, dtype=np.uint8))
    return nbytes / _best_of(3, lambda: crc32c.crc32c(buffer))


def read_rate(directory: str, nbytes: int, direct: bool) -> float:
    """Bytes per second one thread reads a fresh `nbytes` chunk file in `directory` (best of 3,
    O_DIRECT when `direct`, else through the page cache as the store then reads)."""
    raw = np.ones(nbytes + ALIGN, dtype=np.uint8)
    data = memoryview(raw[-raw.ctypes.data % ALIGN :][:nbytes])
    path = os.path.join(directory, f".read-probe.{os.getpid()}-0.tmp")
    try:
        write_chunk(path, data, nbytes, direct)
        return nbytes / _best_of(3, lambda: read_chunk(path, data, nbytes, direct))
    finally:
        os.unlink(path)


def _best_of(n: int, op) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        op()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)
