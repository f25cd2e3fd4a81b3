"""Durable small files: the one way a metadata file (a pointer, a group zarr.json, a manifest,
config.toml, the run id) replaces what was there.

Ordering of `write_atomic`: create a temp file beside the final name (exclusively, so nothing
already there -- another writer's temp, a FIFO, a device -- is ever opened; and through
`open_regular`, so what is not a regular file is named, never waited on), write, fsync it,
rename it over the final name, fsync the directory. The file fsync keeps a rename from ever
naming unwritten bytes (after a power loss the name holds the old content or the new, never an
empty file); the directory fsync makes the rename itself durable. `durable=False` skips only
that last fsync, for a caller whose next flush syncs the whole filesystem anyway (the NVMe
store's commit pointer: one syncfs with the chunk renames it depends on instead of one more
journal commit per shard write).

A file created inside a directory whose own rename is the commit (a checkpoint's manifest) needs
no temp name: written and fsynced, then its directory fsynced (`io.write_durable`, from the
I/O loop through aiofiles).
A killed writer leaves its `.NAME.PID-N.tmp`; the NVMe store removes those at open
(`storage.nvme.generations.remove_orphans`).
"""

from __future__ import annotations

import itertools
import os

from tierzero.storage.filekind import open_regular

TMP_SUFFIX = ".tmp"
_tmp_ids = itertools.count()


def write_atomic(path: str | os.PathLike, raw: bytes, durable: bool = True) -> None:
    """Replace `path` with `raw` all at once: temp file, fsync, rename, directory fsync (the
    last only when `durable`; see the module docstring). Raises OSError."""
    path = os.fspath(path)
    temp = temp_for(path)
    try:
        write_file(temp, raw, sync=True)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_path(os.path.dirname(path) or ".")


def write_file(path: str, raw: bytes, sync: bool = False) -> None:
    """Create `path` (nothing may be there) holding `raw`; `sync`: fsync it before closing."""
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str) -> None:
    """fsync a file or directory that may since have been deleted (then there is nothing to do)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_for(final: str) -> str:
    """The temp name `write_atomic` fills before renaming it to `final`."""
    head, tail = os.path.split(final)
    return os.path.join(head, f".{tail}.{os.getpid()}-{next(_tmp_ids)}{TMP_SUFFIX}")
