"""What a path is before it is opened: a regular file, a directory, or something that would hang.

A run directory and a store are input like any other: a file in them may have been swapped
for a FIFO, a socket or a device, and a plain `open` of a FIFO blocks until a writer appears --
forever. `open_regular` opens with O_NONBLOCK (which does nothing to a regular file) and checks
the descriptor's type with `fstat` before any read or write, so a caller gets an OSError whose
message names what the path is instead of a hang. `kind_of` says it in words for refusals.
"""

from __future__ import annotations

import errno
import os
import stat

_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symbolic link"),
)


def describe_mode(mode: int) -> str:
    """'a FIFO', 'a directory', ...: what a file of `mode` is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def kind_of(path: str | os.PathLike) -> str | None:
    """What `path` itself is (a final symbolic link is not followed), in words; None if nothing
    is there."""
    try:
        return describe_mode(os.lstat(path).st_mode)
    except FileNotFoundError:
        return None


def open_regular(path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A descriptor of the regular file at `path` (created when `flags` say so); anything else
    -- a FIFO, socket, device or directory -- is an OSError naming what it is, without blocking."""
    try:  # looked at first too: opening a FIFO for writing with no reader fails as ENXIO, unnamed
        _refuse_other(os.stat(path).st_mode, path)
    except FileNotFoundError:
        pass
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        _refuse_other(os.fstat(fd).st_mode, path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refuse_other(mode: int, path: str | os.PathLike) -> None:
    if not stat.S_ISREG(mode):
        raise OSError(
            errno.EINVAL, f"is {describe_mode(mode)}, not a regular file", os.fspath(path)
        )


def not_a_file(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be opened as a file ('... is a FIFO, not a regular file'); None when it is
    one or does not exist."""
    kind = kind_of(path)
    return (
        None
        if kind in (None, "a regular file")
        else f"{os.fspath(path)} is {kind}, not a regular file"
    )
