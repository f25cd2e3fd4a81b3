"""`SpareFiles`: chunk files whose blocks a write may overwrite, recycled only once that is safe.

Why: on ext4, O_DIRECT writes over allocated blocks run about twice as fast as writes into a
new file (block allocation and unwritten-extent conversion serialize). So a chunk write fills
a spare file (allocated blocks) and renames it into its new generation's directory.

When is it safe to overwrite a file's blocks? When nothing can ever read them again:
- the generation that held the file is no longer current, *and* that switch is durable: a
  commit only `retire()`s the old generation's files; they become spares at `recycle()`, which
  the store calls after a flush made the commit durable. Before that, a power loss could bring
  the old generation back, and it must still hold its bytes. A flush may run while writes go
  on: it recycles only what was retired before it began (`mark`), the commits its sync covers;
- no checkpoint links the file: a file with more than one link (`st_nlink > 1`) is never
  recycled, only its live name is removed, so a checkpoint's chunks are never overwritten.
Retired files beyond `max_bytes` are simply unlinked (the filesystem itself does not reuse
freed blocks before the freeing transaction commits).

Spares live in `DIR/.tierzero-spare/`, on the same filesystem as the chunks (rename cannot
cross filesystems). `open()` and `close()` empty it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading

SPARE_DIR = ".tierzero-spare"


class SpareFiles:
    """The spare and retired chunk files of one store directory; thread-safe."""

    def __init__(self, root: str, chunk_bytes: int, max_bytes: int = 4 << 30) -> None:
        self.directory = os.path.join(root, SPARE_DIR)
        self.max_spares = max(1, max_bytes // chunk_bytes)
        self._lock = threading.Lock()
        self._idle: list[str] = []
        # files and directories of superseded generations, not yet durable, by retirement number
        self._retired: list[tuple[int, str]] = []
        self._retired_dirs: list[tuple[int, str]] = []
        self._retirements = 0
        self._held: list[tuple[list[str], str]] | None = None  # retirements kept back (`hold`)
        self._names = itertools.count()

    def open(self) -> None:
        """Create the spare directory and empty it (leftovers of a killed run are garbage)."""
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):
            _unlink(os.path.join(self.directory, name))

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

    def retire(self, files: list[str], gen_dir: str) -> None:
        """Record a superseded generation; its blocks are reusable only after `recycle()`."""
        with self._lock:
            if self._held is not None:
                self._held.append((files, gen_dir))
                return
            self._retirements += 1
            self._retired.extend((self._retirements, path) for path in files)
            self._retired_dirs.append((self._retirements, gen_dir))
            overflow = len(self._retired) - self.max_spares
            dropped = self._retired[:overflow] if overflow > 0 else []
            del self._retired[: len(dropped)]
        for _, path in dropped:
            _unlink(path)

    def hold(self, on: bool) -> None:
        """While on, superseded generations stay whole (neither recycled nor unlinked: a re-step
        may read them); turned off, they are retired as if now."""
        with self._lock:
            held, self._held = ([], self._held or []) if on else (self._held or [], None)
        for files, gen_dir in held:
            self.retire(files, gen_dir)

    def mark(self) -> int:
        """The retirements so far: a flush that begins now makes them durable (`recycle(mark)`)."""
        with self._lock:
            return self._retirements

    def recycle(self, upto: int | None = None) -> None:
        """After a flush made the retirements up to `upto` (`mark()` before it; all by default)
        durable: turn their files into spares. Later ones wait for the next flush."""
        with self._lock:
            upto = self._retirements if upto is None else upto
            retired = [path for n, path in self._retired if n <= upto]
            dirs = [path for n, path in self._retired_dirs if n <= upto]
            self._retired = [(n, path) for n, path in self._retired if n > upto]
            self._retired_dirs = [(n, path) for n, path in self._retired_dirs if n > upto]
        for path in retired:
            try:
                if os.stat(path).st_nlink != 1:  # a checkpoint links it: never overwrite it
                    _unlink(path)
                    continue
                with self._lock:
                    room = len(self._idle) < self.max_spares
                if not room:
                    _unlink(path)
                    continue
                spare = os.path.join(self.directory, f"s{os.getpid()}-{next(self._names)}")
                os.rename(path, spare)
            except FileNotFoundError:
                continue
            with self._lock:
                self._idle.append(spare)
        for gen_dir in dirs:
            shutil.rmtree(gen_dir, ignore_errors=True)

    def discard(self, path: str) -> None:
        """A spare that failed mid-write: drop it rather than reuse blocks in unknown state."""
        _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
