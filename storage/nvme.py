"""`NvmeStore`: shards as zarr v3 arrays on one or more SSD directories, moved at disk speed.

Layout (a valid zarr v3 hierarchy per directory; `zarr.open_group(dir)` reads any shard):

    DIR/zarr.json                  root group
    DIR/master/zarr.json           one group per key prefix
    DIR/master/u0003/r0/zarr.json  one 1-D array per key: shape [numel], one `bytes` codec,
    DIR/master/u0003/r0/c/0 ...    chunk files, each exactly `chunk_bytes` (the last one padded)

Because the only codec is `bytes` (little-endian, no compression), a chunk file *is* the raw
shard bytes, so the hot path skips zarr's array API (0.15-0.25x of fio on writes here) and
moves chunks with `chunkfile` (pwrite/preadv, O_DIRECT into aligned buffers), every chunk of
every in-flight shard a separate job on the I/O loop's thread pool. bf16 is stored as `uint16`
with the true dtype in the array's attributes, next to one crc32c per chunk (`zarrmeta`).
Checksums are attributes, not a codec, so chunk files stay aligned for O_DIRECT.

Striping: a key lives in directory `crc32(key) % len(paths)` -- stable for a given list of
paths, so reopen a store with the same paths in the same order. Hashing the whole key spreads
the state kinds of one unit across drives, so the optimizer reads them in parallel.

Atomic writes: every chunk is first written into a spare file (`spares`: already-allocated
blocks, overwritten in place -- twice as fast on ext4 as a new file) and the array's zarr.json
into a temp file beside it; only when all are complete does each chunk swap into place
(renameat2 exchange, or rename), metadata last. A failure before that (ENOSPC included)
removes those files and leaves the previous version intact; a crash during the swaps leaves
chunks whose checksums do not match, which a verified read reports. `flush()` fsyncs written
files and their directories (zarr's LocalStore does not). zarr lists the lock file and the
spare directory as unrecognized objects (a warning), and ignores them. Temp and spare files
orphaned by a killed process are removed at `open()`, under the directory lock.

Metadata is cached in memory: a read never parses JSON after the first one per key, and a write
adds one small zarr.json rename per shard.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import itertools
import os
import re
import shutil
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import crc32c
import torch

from tierzero.storage import chunkfile
from tierzero.storage.base import (Capabilities, ShardNotFoundError, StorageCorruptError,
                                   StorageError, StorageFullError, StoreLockedError, TierStore,
                                   check_flat, check_key, check_out, dtype_name)
from tierzero.storage.spares import SpareFiles
from tierzero.storage.zarrmeta import GROUP_JSON, ShardMeta, nchunks

LOCK_NAME = ".tierzero.lock"
TMP_SUFFIX = ".tmp"
_tmp_ids = itertools.count()
_TMP_NAME = re.compile(r"\..+\.\d+-\d+" + re.escape(TMP_SUFFIX))


def _byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a writable memoryview over the same storage (no copy)."""
    return memoryview(t.detach().view(-1).view(torch.uint8).numpy())


def _temp_for(final: str) -> str:
    head, tail = os.path.split(final)
    return os.path.join(head, f".{tail}.{os.getpid()}-{next(_tmp_ids)}{TMP_SUFFIX}")


@dataclass
class _WriteOp:
    """The not-yet-visible files of one shard write (spares filled with chunks, the zarr.json
    temp), so that an abort or cancel leaves none behind.

    Workers register each file under the lock; `abort()` removes the registered ones and makes
    late workers remove their own; once `commit()` has started it runs to the end.
    """

    spares: SpareFiles
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: list[str] = field(default_factory=list)
    aborted: bool = False
    committing: bool = False

    def write(self, data: memoryview, chunk_bytes: int, direct: bool) -> str | None:
        with self.lock:
            if self.aborted:
                return None
        spare = self.spares.take()
        try:
            chunkfile.write_chunk(spare, data, chunk_bytes, direct)
        except BaseException:
            _unlink(spare)
            raise
        return self._register(spare)

    def _register(self, path: str) -> str | None:
        with self.lock:
            if self.aborted:
                _unlink(path)
                return None
            self.pending.append(path)
        return path

    def write_meta(self, final: str, raw: bytes) -> str | None:
        temp = _temp_for(final)
        try:
            _write_file(temp, raw)
        except BaseException:
            _unlink(temp)
            raise
        return self._register(temp)

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            if not self.committing:
                for path in self.pending:
                    _unlink(path)

    def commit(self, chunks: list[tuple[str, str]], meta: tuple[str, str]) -> bool:
        """Swap every chunk into place, then the metadata (the version's commit point)."""
        with self.lock:
            if self.aborted:
                return False
            self.committing = True
        for spare, final in chunks:
            self.spares.commit(spare, final)
        os.replace(*meta)
        return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class NvmeStore(TierStore):
    """Shards as raw-chunk zarr arrays on `paths`, striped by key; see the module docstring."""

    tier = "nvme"

    def __init__(self, paths: Sequence[str | os.PathLike[str]], chunk_bytes: int = 8 << 20,
                 direct: bool | None = None, verify_always: bool = False) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if not paths:
            raise StorageError("NvmeStore needs at least one directory: pass paths=[...]")
        if chunk_bytes <= 0 or chunk_bytes % chunkfile.ALIGN:
            raise StorageError(f"chunk_bytes must be a positive multiple of {chunkfile.ALIGN} "
                               f"(direct I/O alignment), got {chunk_bytes}")
        self.paths = [os.path.abspath(os.fspath(p)) for p in paths]
        self.chunk_bytes = chunk_bytes
        self.verify_always = verify_always
        self._direct_request = direct
        self._direct: list[bool] = []  # per directory, probed at open()
        self._lock_fds: list[int] = []
        self._spares: list[SpareFiles] = []  # per directory
        self._meta: dict[str, ShardMeta] = {}
        self._key_locks: dict[str, asyncio.Lock] = {}
        self._made_dirs: set[str] = set()
        self._dirty: set[str] = set()  # files and directories to fsync at the next flush
        self._dirty_lock = threading.Lock()  # I/O threads add, flush() takes

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(persistent=True, direct_io=bool(self._direct) and all(self._direct),
                            zero_copy=False)

    # -- open / close ---------------------------------------------------------------------

    def open(self) -> None:
        """Check and lock every directory, probe O_DIRECT, remove orphaned temp files."""
        if self._lock_fds:
            return
        try:
            for path in self.paths:
                self._open_dir(path)
        except BaseException:
            self.close()
            raise

    def _open_dir(self, path: str) -> None:
        if not os.path.isdir(path):
            raise StorageError(f"NVMe store directory {path} does not exist: create it (one "
                               f"directory per drive) or fix the path")
        if not os.access(path, os.W_OK | os.X_OK):
            raise StorageError(f"NVMe store directory {path} is not writable: fix its "
                               f"permissions or choose another path")
        lock_path = os.path.join(path, LOCK_NAME)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StorageError(f"cannot create the lock file {lock_path} ({e.strerror}): make "
                               f"{path} writable or choose another path") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreLockedError(
                f"NVMe store directory {path} is in use by another tierzero store (pid "
                f"{holder}): stop that run, or give this one a different directory") from None
        self._lock_fds.append(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        direct = chunkfile.probe_direct(path)
        if self._direct_request and not direct:
            raise StorageError(f"{path} does not support O_DIRECT (tmpfs?): pass direct=None "
                               f"to fall back to buffered I/O, or use a directory on an SSD")
        self._direct.append(direct if self._direct_request is not False else False)
        spares = SpareFiles(path, self.chunk_bytes)
        spares.open()
        self._spares.append(spares)
        root_json = os.path.join(path, "zarr.json")
        if not os.path.exists(root_json):
            _write_atomic(root_json, GROUP_JSON)
            self._mark_dirty(root_json, path)
        _remove_orphans(path)

    def close(self) -> None:
        """Release the directory locks; does not flush (call `flush()` for durability)."""
        for spares in self._spares:
            spares.close()
        self._spares.clear()
        for fd in self._lock_fds:
            os.close(fd)  # closing the descriptor drops the flock
        self._lock_fds.clear()
        self._direct.clear()
        self._meta.clear()
        self._made_dirs.clear()
        self._key_locks.clear()

    # -- layout ---------------------------------------------------------------------------

    def _dir_index(self, key: str) -> int:
        return zlib.crc32(key.encode()) % len(self.paths)

    def array_dir(self, key: str) -> str:
        """The directory of the zarr array holding `key`."""
        return os.path.join(self.paths[self._dir_index(key)], *key.split("/"))

    def _chunk_path(self, key: str, index: int) -> str:
        return os.path.join(self.array_dir(key), "c", str(index))

    def _require_open(self) -> None:
        if not self._lock_fds:
            raise StorageError("the NVMe store is not open: call open() or use it as a context "
                               "manager")

    def _mark_dirty(self, *paths: str) -> None:
        with self._dirty_lock:
            self._dirty.update(paths)

    def _key_lock(self, key: str) -> asyncio.Lock:
        return self._key_locks.setdefault(key, asyncio.Lock())

    def _make_array_dirs(self, key: str) -> None:
        """Create the array directory and a group zarr.json for every prefix, once per key."""
        root = self.paths[self._dir_index(key)]
        node = root
        for part in key.split("/")[:-1]:
            node = os.path.join(node, part)
            group_json = os.path.join(node, "zarr.json")
            if node not in self._made_dirs and not os.path.exists(group_json):
                os.makedirs(node, exist_ok=True)
                _write_atomic(group_json, GROUP_JSON)
                self._mark_dirty(group_json, node, os.path.dirname(node))
            self._made_dirs.add(node)
        chunks = os.path.join(self.array_dir(key), "c")
        if chunks not in self._made_dirs:
            os.makedirs(chunks, exist_ok=True)
            self._mark_dirty(os.path.dirname(chunks), node)
            self._made_dirs.add(chunks)

    # -- the TierStore primitives ---------------------------------------------------------

    def _check_call(self, key: str, t: torch.Tensor, what: str) -> None:
        check_key(key)
        check_flat(t, what, key)
        if t.device.type != "cpu":
            raise StorageError(f"the NVMe store moves bytes to and from host tensors, but {what} "
                               f"for {key!r} is on {t.device}: use a host buffer")
        self._require_open()

    async def write(self, key: str, src: torch.Tensor) -> None:
        self._check_call(key, src, "src")
        dtype_name(src.dtype)
        loop = asyncio.get_running_loop()
        async with self._key_lock(key):
            await loop.run_in_executor(None, self._make_array_dirs, key)
            data = _byte_view(src)
            direct = self._direct[self._dir_index(key)] and chunkfile.is_aligned(src.data_ptr())
            n = nchunks(len(data), self.chunk_bytes)
            op = _WriteOp(self._spares[self._dir_index(key)])
            finals = [self._chunk_path(key, i) for i in range(n)]
            jobs = [loop.run_in_executor(None, self._write_chunk, op, key, i,
                                         data[i * self.chunk_bytes: (i + 1) * self.chunk_bytes],
                                         direct) for i in range(n)]
            try:
                results = await asyncio.gather(*jobs)
                meta = ShardMeta(src.dtype, src.numel(), self.chunk_bytes,
                                  [crc for _, crc in results])
                meta_final = os.path.join(self.array_dir(key), "zarr.json")
                meta_temp = await loop.run_in_executor(None, self._write_meta, op, key,
                                                       meta_final, meta)
                chunks = [(spare, final) for (spare, _), final in zip(results, finals)]
                await asyncio.shield(loop.run_in_executor(
                    None, self._commit, op, key, chunks, (meta_temp, meta_final), meta))
            except asyncio.CancelledError:
                op.abort()  # late workers remove their own temp files
                raise
            except BaseException:
                op.abort()
                await asyncio.wait(jobs)  # no temp file may outlive the failed write
                raise

    def _write_chunk(self, op: _WriteOp, key: str, index: int, data: memoryview,
                     direct: bool) -> tuple[str | None, int]:
        crc = crc32c.crc32c(data)
        try:
            spare = op.write(data, self.chunk_bytes, direct)
        except OSError as e:
            raise self._write_error(key, f"chunk {index}", e) from e
        return spare, crc

    def _write_meta(self, op: _WriteOp, key: str, final: str, meta: ShardMeta) -> str | None:
        try:
            return op.write_meta(final, meta.to_zarr_json())
        except OSError as e:
            raise self._write_error(key, "zarr.json", e) from e

    def _commit(self, op: _WriteOp, key: str, chunks: list[tuple[str, str]],
                meta_rename: tuple[str, str], meta: ShardMeta) -> None:
        old = self._meta.get(key)
        if not op.commit(chunks, meta_rename):
            return
        # Runs to the end even if the write was cancelled: the renames are the commit point.
        self._meta[key] = meta
        chunk_dir = os.path.join(self.array_dir(key), "c")
        if old is None or len(old.crcs) > len(meta.crcs):  # a shorter version: drop the tail
            for name in os.listdir(chunk_dir):
                if name.isdigit() and int(name) >= len(meta.crcs):
                    _unlink(os.path.join(chunk_dir, name))
        self._mark_dirty(chunk_dir, self.array_dir(key), meta_rename[1],
                         self._spares[self._dir_index(key)].directory,
                         *(final for _, final in chunks))

    def _write_error(self, key: str, what: str, e: OSError) -> StorageError:
        root = self.paths[self._dir_index(key)]
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return StorageFullError(f"no space left in {root} writing {what} of shard {key!r}; "
                                    f"the previous version is intact. Free space there or add "
                                    f"another NVMe directory")
        return StorageError(f"writing {what} of shard {key!r} in {root} failed: {e}")

    async def read_into(self, key: str, out: torch.Tensor, verify: bool = False) -> None:
        self._check_call(key, out, "out")
        loop = asyncio.get_running_loop()
        async with self._key_lock(key):
            meta = self._meta.get(key) or await loop.run_in_executor(None, self._load_meta, key)
            check_out(key, out, meta.dtype, meta.numel)
            data = _byte_view(out)
            direct = self._direct[self._dir_index(key)] and chunkfile.is_aligned(out.data_ptr())
            verify = verify or self.verify_always
            cb = meta.chunk_bytes
            await asyncio.gather(*(
                loop.run_in_executor(None, self._read_chunk, key, i, meta,
                                     data[i * cb: (i + 1) * cb], direct, verify)
                for i in range(meta.nchunks)))

    def _read_chunk(self, key: str, index: int, meta: ShardMeta, out: memoryview,
                    direct: bool, verify: bool) -> None:
        path = self._chunk_path(key, index)
        where = f"chunk {index} of array {self.array_dir(key)}"
        try:
            chunkfile.read_chunk(path, out, meta.chunk_bytes, direct)
        except FileNotFoundError as e:
            raise StorageCorruptError(f"{where} is missing: restore the shard from a "
                                      f"checkpoint") from e
        except chunkfile.ShortChunkError as e:
            raise StorageCorruptError(f"{where} is truncated ({e}): restore the shard from a "
                                      f"checkpoint") from e
        except OSError as e:
            raise StorageError(f"reading {where} failed: {e}") from e
        if verify and crc32c.crc32c(out) != meta.crcs[index]:
            raise StorageCorruptError(f"{where} fails its crc32c check: restore the shard from "
                                      f"a checkpoint")

    def _load_meta(self, key: str) -> ShardMeta:
        path = os.path.join(self.array_dir(key), "zarr.json")
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise ShardNotFoundError(f"no shard {key!r} in the NVMe store ({path} does not "
                                     f"exist): write it before reading it") from None
        meta = ShardMeta.from_zarr_json(raw, path)
        if len(meta.crcs) != meta.nchunks:
            raise StorageCorruptError(f"{path} records {len(meta.crcs)} checksums for "
                                      f"{meta.nchunks} chunks: "
                                      f"restore the shard from a checkpoint")
        self._meta[key] = meta
        return meta

    async def exists(self, key: str) -> bool:
        check_key(key)
        self._require_open()
        return key in self._meta or os.path.exists(os.path.join(self.array_dir(key), "zarr.json"))

    async def delete(self, key: str) -> None:
        check_key(key)
        self._require_open()
        async with self._key_lock(key):
            self._meta.pop(key, None)
            array_dir = self.array_dir(key)
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: shutil.rmtree(array_dir, ignore_errors=True))
            self._made_dirs.discard(os.path.join(array_dir, "c"))
            self._mark_dirty(os.path.dirname(array_dir))

    async def flush(self) -> None:
        """fsync every file and directory written since the last flush, in parallel."""
        self._require_open()
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*(loop.run_in_executor(None, chunkfile.fsync_path, p)
                                   for p in dirty))
        except OSError as e:
            self._mark_dirty(*dirty)
            raise StorageError(f"fsync failed in the NVMe store ({e}): check the drive") from e


def _write_file(path: str, raw: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _write_atomic(path: str, raw: bytes) -> None:
    temp = _temp_for(path)
    try:
        _write_file(temp, raw)
        os.replace(temp, path)
    except BaseException:
        _unlink(temp)
        raise


def _remove_orphans(root: str) -> None:
    """Remove temp files a killed writer left behind (the caller holds the directory lock)."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            if _TMP_NAME.fullmatch(name):
                _unlink(os.path.join(dirpath, name))
