"""One chunk's job on an I/O thread: written into a spare file and renamed into its generation,
or read back (its crc32c checked when asked), with every failure named by shard, chunk and
directory, and the fix. `NvmeStore` runs these under `ChunkJobs`; nothing here locks, commits
or decides what to move.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable

import crc32c
import torch
from tierzero.storage.base import StorageCorruptError, StorageError, StorageFullError
from tierzero.storage.nvme import chunkfile
from tierzero.storage.nvme.chunkjobs import ChunkJobs
from tierzero.storage.nvme.spares import SpareFiles
from tierzero.storage.nvme.zarrmeta import ShardMeta

OnBusy = Callable[[str, float, float], None]  # ("read" | "write", start, end) in perf_counter s


def byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a writable memoryview over the same storage (no copy)."""
    return memoryview(t.detach().view(-1).view(torch.uint8).numpy())


def write_chunk(
    jobs: ChunkJobs,
    spares: SpareFiles,
    key: str,
    index: int,
    data: memoryview,
    chunk_bytes: int,
    direct: bool,
    final: str,
    root: str,
    on_busy: OnBusy | None = None,
) -> int | None:
    """Write chunk `index` of `key` into a spare file and rename it to `final`; its crc32c
    (None when the call was aborted first). A failed spare is discarded, never reused. The
    write and rename's interval goes to `on_busy` (the crc, computed first, is not disk time)."""
    if jobs.aborted:
        return None
    crc = crc32c.crc32c(data)
    spare = spares.take()
    start = time.perf_counter()
    try:
        chunkfile.write_chunk(spare, data, chunk_bytes, direct)
        os.rename(spare, final)
        if on_busy is not None:
            on_busy("write", start, time.perf_counter())
    except OSError as e:
        spares.discard(spare)
        raise write_error(root, key, f"chunk {index}", e) from e
    except BaseException:
        spares.discard(spare)
        raise
    return crc


def write_error(root: str, key: str, what: str, e: OSError) -> StorageError:
    """A write of `what` of shard `key` in directory `root` failed: full, or the drive."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(
            f"no space left in {root} writing {what} of shard {key!r} "
            f"(the previous version is intact): free space there or point "
            f"--nvme-path/--run-dir at a larger filesystem"
        )
    return StorageError(
        f"writing {what} of shard {key!r} in {root} failed ({e}; the "
        f"previous version is intact): check the drive (dmesg) or point "
        f"--nvme-path/--run-dir at another filesystem"
    )


def read_chunk(
    jobs: ChunkJobs,
    key: str,
    gen_dir: str,
    index: int,
    meta: ShardMeta,
    out: memoryview,
    direct: bool,
    verify: bool,
    on_busy: OnBusy | None = None,
) -> None:
    """Read chunk `index` of the generation `gen_dir` into `out`; a missing, short or (with
    `verify`) corrupt chunk is named with the fix. The read's interval goes to `on_busy`."""
    if jobs.aborted:
        return
    path = os.path.join(gen_dir, "c", str(index))
    where = f"chunk {index} of shard {key!r} (array {gen_dir})"
    start = time.perf_counter()
    try:
        chunkfile.read_chunk(path, out, meta.chunk_bytes, direct)
        if on_busy is not None:
            on_busy("read", start, time.perf_counter())
    except FileNotFoundError as e:
        raise StorageCorruptError(f"{where} is missing: restore the shard from a checkpoint") from e
    except chunkfile.ShortChunkError as e:
        raise StorageCorruptError(
            f"{where} is truncated ({e}): restore the shard from a checkpoint"
        ) from e
    except OSError as e:
        raise StorageError(f"reading {where} failed: {e}") from e
    if verify and crc32c.crc32c(out) != meta.crcs[index]:
        raise StorageCorruptError(
            f"{where} fails its crc32c check: restore the shard from a checkpoint"
        )
