"""The lock and the owner record that give one store instance a directory to itself.

Two writers in one store directory would commit over each other's generations and recycle
each other's spares, so `NvmeStore.open()` takes an exclusive `flock` on `DIR/.tierzero.lock`
and writes its pid there for the error another opener sees. Closing the descriptor drops the
lock, also when the process is killed. `DIR/.tierzero-store.json`, the owner record, stays after
the store closes: it marks DIR as a store's root for as long as the store exists.

A store's start-up cleanup removes what a killed writer left anywhere under its root, so a
store may not lie inside another one, nor hold one: `check_nesting` refuses either, live or
closed, before anything is written; and the cleanup never walks into another store's root
(`is_store_root`). Nothing here touches any other file of a directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from tierzero.storage.base import StorageError, StoreLockedError, os_error
from tierzero.storage.durable import write_atomic
from tierzero.storage.filekind import kind_of, open_regular
from tierzero.storage.nvme.generations import GEN_NAME
from tierzero.storage.nvme.spares import SPARE_DIR

LOCK_NAME = ".tierzero.lock"
OWNER_NAME = ".tierzero-store.json"


def is_store_root(path: str | os.PathLike) -> bool:
    """Whether `path` is (or was) an NVMe store's directory: it holds the lock or owner record."""
    return any(os.path.lexists(os.path.join(path, name)) for name in (LOCK_NAME, OWNER_NAME))


def check_directory(path: str) -> None:
    """Refuse a store path that is not a writable directory, or that nests with another store."""
    if not os.path.isdir(path):
        kind = kind_of(path)
        raise StorageError(
            f"NVMe store directory {path} "
            + (f"is {kind}, not a directory" if kind else "does not exist")
            + ": create it (one directory per drive) or fix the path"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise StorageError(
            f"NVMe store directory {path} is not writable: fix its "
            f"permissions or choose another path"
        )
    check_nesting(path)


def check_nesting(path: str) -> None:
    """Refuse a store directory inside or above another store's directory (live or not),
    naming both; run before the store writes anything into `path`."""
    for parent in Path(path).parents:
        if is_store_root(parent):
            raise StorageError(
                f"NVMe store directory {path} lies inside the store directory {parent} of "
                "another run, whose start-up cleanup would remove this one's files: give "
                "each store a directory of its own, side by side"
            )
    inner = next(stores_below(path), None)
    if inner is not None:
        raise StorageError(
            f"NVMe store directory {path} holds the store directory {inner} of another "
            "run, whose files this one's start-up cleanup would remove: give each store a "
            "directory of its own, side by side"
        )


def stores_below(root: str) -> Iterator[str]:
    """Store directories strictly under `root` (symbolic links, generations and spares unwalked)."""
    for dirpath, dirnames, _ in os.walk(root):
        if dirpath != root and is_store_root(dirpath):
            dirnames[:] = []
            yield dirpath
            continue
        dirnames[:] = [d for d in dirnames if d != SPARE_DIR and not GEN_NAME.fullmatch(d)]


def lock_directory(path: str) -> int:
    """Lock the store directory `path` for this process and record it as a store's root; the
    descriptor to close to unlock."""
    lock_path = os.path.join(path, LOCK_NAME)
    try:
        fd = open_regular(lock_path, os.O_RDWR | os.O_CREAT)
    except OSError as e:
        raise StorageError(
            f"cannot create the lock file {lock_path} ({e.strerror}): make "
            f"{path} writable or choose another path"
        ) from e
    holder = try_lock(fd)
    if holder is not None:
        raise StoreLockedError(
            f"NVMe store directory {path} is in use by another tierzero store (pid "
            f"{holder}): stop that run, or give this one a different directory"
        )
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        owner = os.path.join(path, OWNER_NAME)
        if not os.path.lexists(owner):
            record = {"store": uuid.uuid4().hex, "created": time.time(), "pid": os.getpid()}
            # not made durable here: one lost to a power loss is written again at the next open
            write_atomic(owner, json.dumps(record).encode(), durable=False)
    except OSError as e:
        os.close(fd)
        raise os_error(e, "writing", lock_path) from e
    return fd


def try_lock(fd: int) -> str | None:
    """Take the exclusive lock of the open lock file `fd` without waiting: None, or (`fd` then
    closed) the pid its holder wrote there, "unknown" if none (a store's lock, a run
    directory's)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        return holder
    return None
