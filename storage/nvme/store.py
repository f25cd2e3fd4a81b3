"""`NvmeStore`: shards as zarr v3 arrays on one or more SSD directories, moved at disk speed.

Layout (a valid zarr v3 hierarchy per directory; `zarr.open_group(dir)` reads any shard):

    DIR/zarr.json                         root group
    DIR/master/u0003/r0/zarr.json         the shard's group; attributes.tierzero.current names
                                          the current generation -- the shard's commit point
    DIR/master/u0003/r0/g000017/zarr.json the generation's array: shape [numel], one `bytes`
    DIR/master/u0003/r0/g000017/c/0 ...   codec, crc32c per chunk; chunk files exactly
                                          `chunk_bytes` (the last one zero-padded)

Because the only codec is `bytes`, a chunk file *is* the raw shard bytes, so the hot path skips
zarr's array API and moves chunks with `chunkfile` (pwrite/preadv, O_DIRECT into aligned
buffers), every chunk a separate job on the I/O loop's thread pool. bf16 is stored as `uint16`
with the true dtype in the attributes (`zarrmeta`).

Durability (see DESIGN.md, "Invariants"). A write fills a new generation directory (chunks
written into spare files, renamed in), writes its array zarr.json, then replaces the shard's
group zarr.json with one `rename` that names the new generation: that rename is the only
commit point, so a reader sees the whole old version or the whole new one.
- After SIGKILL (or ENOSPC/EIO at any chunk): the kernel's view is consistent. The shard is the
  old generation unless the rename happened; a half-written generation directory is an orphan
  that `open()` removes. Nothing is fsynced for this guarantee.
- After power loss: only what `flush()` made durable is guaranteed. `flush()` syncs the
  filesystem (data, new files, renames); a shard written after the last flush may come back as
  either version, and if its generation's data did not reach the disk, a verified read names
  the chunk (`StorageCorruptError`) -- it is never silently mixed. A superseded generation's
  blocks are reused (as spares) only after the flush that made its replacement durable, and a
  chunk with another hard link (a checkpoint's) is never reused or written in place.
Checkpoints rely on that: they flush, then hard-link the current generations (`freeze`).

Reads and writes return only when no I/O thread can touch the caller's buffer any more, even
when chunks failed or the call was cancelled (`chunkjobs`); each chunk's job, its errors and
its timing (`on_busy`) are `chunkio`'s; pointer and generation files are `generations`', the
directory lock `dirlock`'s. Direct I/O that is not possible (no O_DIRECT, tmpfs, an unaligned
buffer) falls back to buffered I/O, said once in `notes`. Metadata is cached after each key's
first read. `verify_reads`: every read checks each chunk's crc32c (a flipped bit names it).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import zlib
from collections.abc import Callable, Sequence

import torch
from tierzero.storage.base import (
    Capabilities,
    ShardNotFoundError,
    StorageCorruptError,
    StorageError,
    TierStore,
    check_flat,
    check_key,
    check_out,
    dtype_name,
    os_error,
)
from tierzero.storage.durable import write_atomic, write_file
from tierzero.storage.nvme import chunkfile
from tierzero.storage.nvme.arrays import link_array
from tierzero.storage.nvme.chunkio import OnBusy, byte_view, read_chunk, write_chunk, write_error
from tierzero.storage.nvme.chunkjobs import ChunkJobs, shielded
from tierzero.storage.nvme.dirlock import check_directory, is_store_root, lock_directory
from tierzero.storage.nvme.generations import (
    GEN_NAME,
    Current,
    gen_name,
    pointer_json,
    read_pointer,
    remove_orphans,
)
from tierzero.storage.nvme.spares import SpareFiles
from tierzero.storage.nvme.zarrmeta import GROUP_JSON, ShardMeta, nchunks


class NvmeStore(TierStore):
    """Shards as raw-chunk zarr arrays on `paths`, striped by key; see the module docstring."""

    tier = "nvme"
    on_busy: OnBusy | None = None  # each chunk's read or write interval, to whoever times links

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        chunk_bytes: int = 8 << 20,
        direct: bool | None = None,
        verify_reads: bool | None = False,
        layout: Callable[[str, torch.Tensor], dict | None] | None = None,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if not paths:
            raise StorageError("NvmeStore needs at least one directory: pass paths=[...]")
        if chunk_bytes <= 0 or chunk_bytes % chunkfile.ALIGN:
            raise StorageError(
                f"chunk_bytes must be a positive multiple of {chunkfile.ALIGN} "
                f"(direct I/O alignment), got {chunk_bytes}"
            )
        self.paths = [os.path.abspath(os.fspath(p)) for p in paths]
        self.chunk_bytes = chunk_bytes
        self.verify_reads = verify_reads  # crc32c-check every read; None: decided at open
        self.layout = layout  # (key, data) -> the array's `layout` attribute, or None
        self.notes: list[str] = []  # what the store could not do as asked, each said once
        self._direct_request = direct
        self._direct: list[bool] = []  # per directory, probed at open()
        self._lock_fds: list[int] = []
        self._spares: list[SpareFiles] = []  # per directory
        self._current: dict[str, Current] = {}
        # while `hold`ing: each key's first replaced generation
        self._previous: dict[str, Current] | None = None
        self._key_locks: dict[str, asyncio.Lock] = {}
        self._made_dirs: set[str] = set()
        self._note_lock = threading.Lock()

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            persistent=True, direct_io=bool(self._direct) and all(self._direct), zero_copy=False
        )

    def _note(self, text: str) -> None:
        with self._note_lock:
            if text not in self.notes:
                self.notes.append(text)

    # -- open / close ---------------------------------------------------------------------

    def open(self) -> None:
        """Check and lock every directory, probe O_DIRECT, remove orphaned generations."""
        if self._lock_fds:
            return
        try:
            for path in self.paths:
                self._open_dir(path)
            if self.verify_reads is None:  # auto: on where checking costs under 5% of a read
                self.verify_reads = chunkfile.verify_is_cheap(
                    self.paths[0], self.chunk_bytes, self._direct[0]
                )
        except BaseException:
            self.close()
            raise

    def _open_dir(self, path: str) -> None:
        check_directory(path)  # before anything is written there
        self._lock_fds.append(lock_directory(path))
        try:
            self._direct.append(self._probe_direct(path))
            spares = SpareFiles(path, self.chunk_bytes)
            spares.open()
            self._spares.append(spares)
            root_json = os.path.join(path, "zarr.json")
            if not os.path.exists(root_json):
                write_atomic(root_json, GROUP_JSON)
            remove_orphans(path, foreign=is_store_root)
        except OSError as e:
            raise os_error(e, "opening the NVMe store in", path) from e

    def _probe_direct(self, path: str) -> bool:
        fs = chunkfile.filesystem_type(path)
        accepts = chunkfile.probe_direct(path) and fs not in chunkfile.MEMORY_FILESYSTEMS
        if self._direct_request and not accepts:
            raise StorageError(
                f"{path} does not support O_DIRECT ({fs}): pass direct=None to fall "
                f"back to buffered I/O, or use a directory on an SSD"
            )
        if self._direct_request is False:
            return False
        if not accepts:
            self._note(f"{path} is on {fs}, which has no direct I/O: buffered I/O there")
        return accepts

    def close(self) -> None:
        """Release the directory locks; does not flush (call `flush()` for durability)."""
        for spares in self._spares:
            spares.close()
        self._spares.clear()
        for fd in self._lock_fds:
            os.close(fd)  # closing the descriptor drops the flock
        self._lock_fds.clear()
        self._direct.clear()
        self._current.clear()
        self._made_dirs.clear()
        self._key_locks.clear()

    # -- layout ---------------------------------------------------------------------------

    def _dir_index(self, key: str) -> int:
        return zlib.crc32(key.encode()) % len(self.paths)

    def _root(self, key: str) -> str:
        return self.paths[self._dir_index(key)]

    def shard_dir(self, key: str) -> str:
        """The directory of the zarr group holding `key`'s generations."""
        return os.path.join(self._root(key), *key.split("/"))

    def array_dir(self, key: str) -> str:
        """The directory of `key`'s current generation (a zarr array)."""
        return self._gen_dir(key, self._current[key].gen)

    def _gen_dir(self, key: str, gen: int) -> str:
        return os.path.join(self.shard_dir(key), gen_name(gen))

    def _require_open(self) -> None:
        if not self._lock_fds:
            raise StorageError(
                "the NVMe store is not open: call open() or use it as a context manager"
            )

    def _key_lock(self, key: str) -> asyncio.Lock:
        return self._key_locks.setdefault(key, asyncio.Lock())

    def _make_group_dirs(self, key: str) -> None:
        """Create the shard directory and a group zarr.json for every prefix, once per key."""
        node = self.paths[self._dir_index(key)]
        for part in key.split("/")[:-1]:
            node = os.path.join(node, part)
            if node in self._made_dirs:
                continue
            group_json = os.path.join(node, "zarr.json")
            if not os.path.exists(group_json):
                os.makedirs(node, exist_ok=True)
                write_atomic(group_json, GROUP_JSON)
            self._made_dirs.add(node)
        os.makedirs(self.shard_dir(key), exist_ok=True)

    def _new_gen_dir(self, key: str, gen: int) -> str:
        self._make_group_dirs(key)
        gen_dir = self._gen_dir(key, gen)
        if os.path.exists(gen_dir):  # a failed write's leftover in this process: never current
            shutil.rmtree(gen_dir)
        os.makedirs(os.path.join(gen_dir, "c"))
        return gen_dir

    # -- the TierStore primitives ---------------------------------------------------------

    def _check_call(self, key: str, t: torch.Tensor, what: str) -> None:
        check_key(key)
        check_flat(t, what, key)
        if t.device.type != "cpu":
            raise StorageError(
                f"the NVMe store moves bytes to and from host tensors, but {what} "
                f"for {key!r} is on {t.device}: use a host buffer"
            )
        self._require_open()

    def _use_direct(self, key: str, t: torch.Tensor) -> bool:
        if not self._direct[self._dir_index(key)]:
            return False
        if chunkfile.is_aligned(t.data_ptr()):
            return True
        self._note(
            "a host buffer not aligned to 4 KiB was moved with buffered I/O; lease "
            "buffers from the host pool for direct I/O"
        )
        return False

    async def write(self, key: str, src: torch.Tensor) -> None:
        self._check_call(key, src, "src")
        dtype_name(src.dtype)  # a dtype the store cannot name is refused before anything is written
        loop = asyncio.get_running_loop()
        async with self._key_lock(key):
            current = await self._lookup(key, missing_ok=True)
            gen = current.gen + 1 if current is not None else 1
            try:
                gen_dir = await loop.run_in_executor(None, self._new_gen_dir, key, gen)
            except OSError as e:
                raise write_error(self._root(key), key, "its generation directory", e) from e
            data = byte_view(src)
            direct = self._use_direct(key, src)
            cb = self.chunk_bytes
            jobs = ChunkJobs()
            spares = self._spares[self._dir_index(key)]
            committed = False
            try:
                crcs = await jobs.run(
                    [
                        loop.run_in_executor(
                            None,
                            write_chunk,
                            jobs,
                            spares,
                            key,
                            i,
                            data[i * cb : (i + 1) * cb],
                            cb,
                            direct,
                            os.path.join(gen_dir, "c", str(i)),
                            self._root(key),
                            self.on_busy,
                        )
                        for i in range(nchunks(len(data), cb))
                    ]
                )
                meta = ShardMeta(
                    src.dtype, src.numel(), cb, crcs, self.layout(key, src) if self.layout else None
                )
                # the commit runs to the end even if this call is cancelled meanwhile
                commit = loop.run_in_executor(None, self._commit, key, gen, meta, current)
                await shielded(commit)
                committed = True
            finally:
                if not committed:  # nothing names this generation: remove it whole
                    await shielded(
                        loop.run_in_executor(
                            None, lambda: shutil.rmtree(gen_dir, ignore_errors=True)
                        )
                    )

    def _commit(self, key: str, gen: int, meta: ShardMeta, previous: Current | None) -> None:
        """Write the generation's array metadata, then switch the shard to it (one rename)."""
        gen_dir = self._gen_dir(key, gen)
        try:
            write_file(os.path.join(gen_dir, "zarr.json"), meta.to_zarr_json())
            # the commit point; the rename is made durable by the next flush (`generations`)
            write_atomic(
                os.path.join(self.shard_dir(key), "zarr.json"), pointer_json(gen), durable=False
            )
        except OSError as e:
            raise write_error(self._root(key), key, "zarr.json", e) from e
        self._current[key] = Current(gen, meta)
        if previous is not None:
            if self._previous is not None:  # held: whole and readable until `hold(False)`
                self._previous.setdefault(key, previous)
            old_dir = self._gen_dir(key, previous.gen)
            self._spares[self._dir_index(key)].retire(
                [os.path.join(old_dir, "c", str(i)) for i in range(previous.meta.nchunks)], old_dir
            )

    async def read_into(
        self, key: str, out: torch.Tensor, verify: bool = False, previous: bool = False
    ) -> None:
        self._check_call(key, out, "out")
        loop = asyncio.get_running_loop()
        async with self._key_lock(key):
            current = await self._lookup(key)
            # `hold`: as it began
            current = self._previous.get(key, current) if previous else current
            meta = current.meta
            check_out(key, out, meta.dtype, meta.numel)
            data = byte_view(out)
            direct = self._use_direct(key, out)
            verify = verify or bool(self.verify_reads)
            cb = meta.chunk_bytes
            gen_dir = self._gen_dir(key, current.gen)
            jobs = ChunkJobs()
            await jobs.run(
                [
                    loop.run_in_executor(
                        None,
                        read_chunk,
                        jobs,
                        key,
                        gen_dir,
                        i,
                        meta,
                        data[i * cb : (i + 1) * cb],
                        direct,
                        verify,
                        self.on_busy,
                    )
                    for i in range(meta.nchunks)
                ]
            )

    def hold(self, on: bool) -> None:
        """While on, each shard's generation of when it began stays readable
        (`read_into(previous=True)`)."""
        self._previous = {} if on else None
        for spares in self._spares:
            spares.hold(on)

    async def _lookup(self, key: str, missing_ok: bool = False) -> Current | None:
        if key in self._current:
            return self._current[key]
        found = await asyncio.get_running_loop().run_in_executor(None, self._load_current, key)
        if found is None and not missing_ok:
            raise ShardNotFoundError(
                f"no shard {key!r} in the NVMe store ({self.shard_dir(key)} "
                f"has no zarr.json): write it before reading it"
            )
        return found

    def _load_current(self, key: str) -> Current | None:
        found = read_pointer(self.shard_dir(key))
        if found is None:
            return None
        self._current[key] = Current(*found)
        return self._current[key]

    async def exists(self, key: str) -> bool:
        check_key(key)
        self._require_open()
        return key in self._current or os.path.exists(
            os.path.join(self.shard_dir(key), "zarr.json")
        )

    async def delete(self, key: str) -> None:
        check_key(key)
        self._require_open()
        async with self._key_lock(key):
            self._current.pop(key, None)
            shard_dir = self.shard_dir(key)
            try:
                await asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, shard_dir)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise StorageError(f"deleting shard {key!r} ({shard_dir}) failed: {e}") from e

    async def flush(self) -> None:
        """Make every completed write durable (syncfs per directory), then let the blocks of
        generations retired before the sync began be reused (later ones wait for the next)."""
        self._require_open()
        loop = asyncio.get_running_loop()
        marks = [spares.mark() for spares in self._spares]
        try:
            await asyncio.gather(
                *(loop.run_in_executor(None, chunkfile.sync_filesystem, p) for p in self.paths)
            )
        except OSError as e:
            raise StorageError(f"syncing the NVMe store failed ({e}): check the drive") from e
        try:
            for spares, mark in zip(self._spares, marks):
                await loop.run_in_executor(None, spares.recycle, mark)
        except OSError as e:
            raise os_error(e, "recycling spare chunks in", e.filename or spares.directory) from e

    # -- checkpoints ----------------------------------------------------------------------

    async def freeze(
        self, key: str, dst_dir: str, sync: bool = True, verify: bool = False
    ) -> tuple[ShardMeta, int]:
        """Hard-link the current generation of `key` into the frozen array `dst_dir`; returns
        its metadata and the bytes copied (0 unless `dst_dir` is on another filesystem).
        Call `flush()` first: a checkpoint must link durable chunks. `sync=False`: the caller
        syncs `dst_dir`'s filesystem afterwards. `verify`: link no chunk that fails its crc32c."""
        check_key(key)
        self._require_open()
        async with self._key_lock(key):
            current = await self._lookup(key)
            copied = await asyncio.get_running_loop().run_in_executor(
                None,
                link_array,
                self._gen_dir(key, current.gen),
                dst_dir,
                current.meta,
                True,
                sync,
                verify,
            )
        return current.meta, copied

    async def adopt(self, key: str, src_dir: str, meta: ShardMeta) -> int:
        """Make the frozen array `src_dir` (a checkpoint's) `key`'s new current generation, by
        hard links; returns bytes copied. Its chunks stay linked, so they are never recycled."""
        check_key(key)
        self._require_open()
        loop = asyncio.get_running_loop()
        async with self._key_lock(key):
            try:
                current = await self._lookup(key, missing_ok=True)
            except StorageCorruptError:  # e.g. a pointer torn by a power loss: replace it whole
                current = None
            gen = current.gen + 1 if current is not None else self._next_free_gen(key)
            try:
                gen_dir = await loop.run_in_executor(None, self._new_gen_dir, key, gen)
            except OSError as e:
                raise write_error(self._root(key), key, "its generation directory", e) from e
            committed = False
            try:
                copied = await loop.run_in_executor(None, link_array, src_dir, gen_dir, meta, False)
                await shielded(loop.run_in_executor(None, self._commit, key, gen, meta, current))
                committed = True
            finally:
                if not committed:
                    await shielded(
                        loop.run_in_executor(
                            None, lambda: shutil.rmtree(gen_dir, ignore_errors=True)
                        )
                    )
        return copied

    def _next_free_gen(self, key: str) -> int:
        """A generation number above every generation directory of `key` on disk."""
        try:
            names = os.listdir(self.shard_dir(key))
        except FileNotFoundError:
            return 1
        return 1 + max((int(m.group(1)) for n in names if (m := GEN_NAME.fullmatch(n))), default=0)
