"""Reading the small files of a run directory (manifests, config.toml, zarr.json) safely.

A run directory is input like any other: a file in it may have been swapped for a FIFO, a
device or a symbolic link. `read_regular` opens without following a final symlink and without
blocking (O_NOFOLLOW | O_NONBLOCK), then refuses anything that is not a regular file, so a
reader such as `tierzero inspect` never hangs on a FIFO and never reads outside the directory
through a link. Small-file writes that must survive power loss go through
`storage.durable.write_atomic`. An export killed mid-file leaves its `.NAME.PID.tmp`;
`remove_stale_temps` removes those of processes that are gone.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from tierzero.storage.filekind import describe_mode

_TEMP_NAME = re.compile(r"\..+\.(\d+)\.tmp")

MAX_SMALL_BYTES = 1 << 30  # a manifest of a very large model is megabytes; never read more


def read_regular(path: str | Path, limit: int = MAX_SMALL_BYTES) -> bytes:
    """The bytes of the regular file at `path`; OSError (its strerror says why) for anything
    else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(
                errno.ELOOP, "is a symbolic link, not a regular file", str(path)
            ) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"is {describe_mode(mode)}, not a regular file", str(path))
        chunks, total = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise OSError(errno.EFBIG, f"is larger than {limit} bytes", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def is_regular(path: str | Path) -> bool:
    """Whether `path` itself (not what a link points to) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove the `.NAME.PID.tmp` files in `folder` whose writer (PID) is no longer running;
    returns them. A live writer's are left to it."""
    removed = []
    for entry in os.scandir(folder):
        match = _TEMP_NAME.fullmatch(entry.name)
        if (
            match is None
            or not entry.is_file(follow_symlinks=False)
            or _running(int(match.group(1)))
        ):
            continue
        Path(entry.path).unlink(missing_ok=True)
        removed.append(Path(entry.path))
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
