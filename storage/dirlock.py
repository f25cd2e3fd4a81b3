"""The lock that gives one store instance a directory to itself.

Two writers in one store directory would commit over each other's generations and recycle
each other's spares, so `NvmeStore.open()` takes an exclusive `flock` on `DIR/.tierzero.lock`
and writes its pid there for the error another opener sees. Closing the descriptor drops the
lock, also when the process is killed. It never touches anything else in the directory.
"""

from __future__ import annotations

import fcntl
import os

from tierzero.storage.base import StorageError, StoreLockedError, os_error

LOCK_NAME = ".tierzero.lock"


def lock_directory(path: str) -> int:
    """Lock the store directory `path` for this process; the descriptor to close to unlock."""
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
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError as e:
        os.close(fd)
        raise os_error(e, "writing", lock_path) from e
    return fd
