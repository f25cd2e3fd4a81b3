"""Frozen arrays: shards written once and never changed, as in a checkpoint.

A frozen array is the same raw-chunk zarr v3 array the NVMe store keeps per generation
(`DIR/zarr.json` + `DIR/c/<i>`, each chunk exactly `chunk_bytes`), so `zarr.open_array(DIR)`
reads it. It is made by hard-linking a live generation's chunk files (`link_array`: metadata
only, no bytes move) or, for state that lives in memory, by writing the bytes (`write_array`).
Readers check every chunk against the crc32c list the caller trusts (the checkpoint manifest's),
so a flipped byte, a truncated or a missing chunk is named, never loaded.

These helpers block: run them on I/O threads, or from a CLI command. They never overwrite a
file in place: a chunk that a checkpoint links stays as it was written.
"""

from __future__ import annotations

import errno
import os
import shutil

import crc32c
import numpy as np
import torch
from tierzero.storage.base import StorageCorruptError, StorageError, os_error
from tierzero.storage.durable import fsync_path
from tierzero.storage.nvme import chunkfile
from tierzero.storage.nvme.zarrmeta import ShardMeta


def chunk_path(array_dir: str, index: int) -> str:
    return os.path.join(array_dir, "c", str(index))


def link_array(
    src_dir: str,
    dst_dir: str,
    meta: ShardMeta,
    with_meta: bool = True,
    sync: bool = True,
    verify: bool = False,
) -> int:
    """Make `dst_dir` an array holding `src_dir`'s chunks by hard links (and its zarr.json,
    unless the caller writes that); returns the bytes copied instead (0 on one filesystem,
    the array's size where links cannot cross). `sync=False`: the caller syncs the
    filesystem afterwards (one syncfs instead of three fsyncs per array). `verify`: check each
    chunk against `meta` first, so a damaged chunk is named and never linked into a checkpoint
    (a link shares the damage). An OSError (ENOSPC, EIO, EACCES) is a `StorageError` naming the
    path and the fix."""
    try:
        if verify:
            verify_array(src_dir, meta)
        return _link_array(src_dir, dst_dir, meta, with_meta, sync)
    except FileNotFoundError as e:
        raise StorageCorruptError(
            f"{e.filename} is missing, so {src_dir} cannot be linked: restore it from a checkpoint"
        ) from e
    except OSError as e:  # os.link names (src, dst): the write that failed is dst's
        raise os_error(e, "linking", e.filename2 or e.filename or dst_dir) from e


def _link_array(src_dir: str, dst_dir: str, meta: ShardMeta, with_meta: bool, sync: bool) -> int:
    os.makedirs(os.path.join(dst_dir, "c"), exist_ok=True)
    copied = 0
    for i in range(meta.nchunks):
        src, dst = chunk_path(src_dir, i), chunk_path(dst_dir, i)
        try:
            os.link(src, dst)
        except FileExistsError:
            if not os.path.samefile(src, dst):
                raise StorageError(
                    f"{dst} exists and is not {src}: remove the partial "
                    f"directory {dst_dir} and try again"
                ) from None
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            shutil.copyfile(src, dst)  # another filesystem: copy, the caller says so once
            if sync:
                fsync_path(dst)
            copied += meta.chunk_bytes
    if with_meta:
        _write_meta(dst_dir, meta, sync)
    return copied


def write_array(
    dst_dir: str, src: torch.Tensor, chunk_bytes: int, layout: dict | None = None
) -> ShardMeta:
    """Write the contiguous 1-D host tensor `src` as a new frozen array, fsynced; its meta
    (with `layout`, what its bytes pack, as `ShardMeta.layout`).
    An OSError (ENOSPC, EIO, EACCES) is a `StorageError` naming the path and the fix."""
    data = memoryview(src.detach().contiguous().view(-1).view(torch.uint8).numpy())
    path = dst_dir
    try:
        os.makedirs(os.path.join(dst_dir, "c"), exist_ok=True)
        crcs = []
        for i in range(0, max(1, -(-len(data) // chunk_bytes))):
            part = data[i * chunk_bytes : (i + 1) * chunk_bytes]
            crcs.append(crc32c.crc32c(part))
            path = chunk_path(dst_dir, i)
            chunkfile.write_chunk(path, part, chunk_bytes, direct=False)
            fsync_path(path)
        meta = ShardMeta(src.dtype, src.numel(), chunk_bytes, crcs, layout)
        path = os.path.join(dst_dir, "zarr.json")
        _write_meta(dst_dir, meta)
    except OSError as e:
        raise os_error(e, "writing", path) from e
    return meta


def read_array(src_dir: str, meta: ShardMeta, out: torch.Tensor | None = None) -> torch.Tensor:
    """The array's elements (into `out` if given), every chunk checked against `meta`."""
    if out is None:
        out = torch.empty(meta.numel, dtype=meta.dtype)
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    cb = meta.chunk_bytes
    for i in range(meta.nchunks):
        part = view[i * cb : (i + 1) * cb]
        _read_checked(src_dir, i, part, meta)
    return out


def verify_array(src_dir: str, meta: ShardMeta, buffer: np.ndarray | None = None) -> None:
    """Check every chunk of the array against `meta` through one chunk-sized buffer."""
    if buffer is None or buffer.nbytes < meta.chunk_bytes:
        buffer = np.empty(meta.chunk_bytes, dtype=np.uint8)
    view = memoryview(buffer)
    for i in range(meta.nchunks):
        length = min(meta.chunk_bytes, meta.nbytes - i * meta.chunk_bytes)
        _read_checked(src_dir, i, view[:length], meta)


def _read_checked(src_dir: str, index: int, part: memoryview, meta: ShardMeta) -> None:
    path = chunk_path(src_dir, index)
    try:
        chunkfile.read_chunk(path, part, meta.chunk_bytes, direct=False)
    except FileNotFoundError:
        raise StorageCorruptError(f"{path} is missing") from None
    except chunkfile.ShortChunkError as e:
        raise StorageCorruptError(f"{path} is truncated ({e})") from None
    except OSError as e:
        raise StorageError(f"reading {path} failed: {e}") from e
    if crc32c.crc32c(part) != meta.crcs[index]:
        raise StorageCorruptError(f"{path} fails its crc32c check (a flipped byte or a torn write)")


def _write_meta(array_dir: str, meta: ShardMeta, sync: bool = True) -> None:
    path = os.path.join(array_dir, "zarr.json")
    with open(path, "wb") as f:
        f.write(meta.to_zarr_json())
        if sync:
            f.flush()
            os.fsync(f.fileno())
    if sync:
        fsync_path(os.path.join(array_dir, "c"))
        fsync_path(array_dir)
