"""`SpareFiles`: already-allocated chunk files that writes fill, recycled by atomic exchange.

Why: on ext4, O_DIRECT writes over allocated blocks run about twice as fast as writes into a
new file (block allocation and unwritten-extent conversion serialize). So a chunk write fills a
spare file, then `renameat2(RENAME_EXCHANGE)` atomically swaps it with the chunk file: the chunk
path now holds the new bytes, and the spare path holds the previous version's blocks, ready to
be overwritten by the next write. The first write of a chunk (no file yet) renames its spare
into place instead. Either way readers see the old chunk or the new one, never a torn one.

Spares live in `DIR/.tierzero-spare/`, on the same filesystem as the chunks (exchange and rename
cannot cross filesystems). A shard write fills all its chunks before swapping any of them in,
so the pool grows to the bytes of concurrent writes -- the same space any atomic write needs
while old and new versions coexist -- and keeps up to `max_bytes` of them (default 4 GiB per
directory) for the next writes; `open()` and `close()` remove them all. Where RENAME_EXCHANGE
is missing (not Linux, or a filesystem that refuses it), the chunk is renamed over and its old
blocks are freed: still atomic, just slower.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import threading

SPARE_DIR = ".tierzero-spare"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _load_renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # ctypes releases the GIL per call
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


class SpareFiles:
    """The spare chunk files of one store directory; thread-safe."""

    def __init__(self, root: str, chunk_bytes: int, max_bytes: int = 4 << 30) -> None:
        self.directory = os.path.join(root, SPARE_DIR)
        self.max_spares = max(1, max_bytes // chunk_bytes)
        self._lock = threading.Lock()
        self._idle: list[str] = []
        self._names = itertools.count()
        self._can_exchange = _renameat2 is not None

    def open(self) -> None:
        """Create the spare directory and empty it (leftovers of a killed run are garbage)."""
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):
            os.unlink(os.path.join(self.directory, name))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for path in idle:
            _unlink(path)

    def take(self) -> str:
        """A path to write a chunk into: an idle spare (allocated blocks) or a new name."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return os.path.join(self.directory, f"s{os.getpid()}-{next(self._names)}")

    def commit(self, spare: str, final: str) -> None:
        """Atomically make `final` hold the bytes written to `spare`; keep the old blocks."""
        if self._can_exchange and self._exchange(spare, final):
            with self._lock:
                if len(self._idle) < self.max_spares:
                    self._idle.append(spare)
                    return
            _unlink(spare)
            return
        os.replace(spare, final)

    def _exchange(self, spare: str, final: str) -> bool:
        assert _renameat2 is not None
        if _renameat2(_AT_FDCWD, os.fsencode(spare), _AT_FDCWD, os.fsencode(final),
                      _RENAME_EXCHANGE) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.ENOENT:  # the chunk's first version: rename instead
            return False
        if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            self._can_exchange = False  # this filesystem cannot exchange; rename from now on
            return False
        raise OSError(err, os.strerror(err), final)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
