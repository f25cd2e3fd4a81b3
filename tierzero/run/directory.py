"""The run directory: its lock, its lineage, its resolved `config.toml` and its `metrics.jsonl`.

One trainer per directory: `open()` takes an exclusive, non-blocking `flock` on `lock`, so a
second trainer is refused at once (and a crashed one leaves no stale lock: the kernel drops it).
With several ranks the run is one trainer: rank 0 (`primary`) holds the lock and writes the
config and metrics; the other ranks only make sure the directory exists.

Paths in config.toml that lie inside the run directory (the default `nvme`) are stored relative
to it, and read back against it (`rebase_paths`), so a copied or moved run directory resumes
against its own store, from any working directory. Paths outside it are stored absolute.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from tierzero.checkpoint import lineage
from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.checkpoint.files import write_small_durable
from tierzero.config import RunConfig, to_toml
from tierzero.errors import RunDirError

CONFIG_NAME = "config.toml"


class RunDir:
    def __init__(self, path: str | os.PathLike, primary: bool = True) -> None:
        self.path = Path(path)
        self.primary = primary
        self._lock_fd: int | None = None
        self._metrics = None

    def open(self) -> RunDir:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"cannot create run directory '{self.path}' ({e.strerror}); "
                              "choose a writable --run-dir") from None
        if not self.primary:
            return self
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(f"run directory '{self.path}' is in use by another trainer (pid {owner}); "
                              "wait for it to finish or choose another --run-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        self._metrics = open(self.path / "metrics.jsonl", "a", buffering=1)
        return self

    def start(self, resume: bool, overwrite: bool = False) -> list[str]:
        """Begin or continue this directory's lineage (rank 0; under the lock); returns notes.

        A fresh run into a directory holding checkpoints is refused unless `overwrite`, which
        moves them aside into checkpoints/abandoned/; a resumed one keeps its run id."""
        if not self.primary:
            return []
        if resume:
            lineage.run_id(self.path)
            return []
        steps = [s for s, _ in checkpoint_dirs(self.path)]
        if steps and not overwrite:
            raise RunDirError(refuse_fresh_start(self.path, steps))
        notes = []
        if steps:
            notes.append(lineage.abandoned_note(self.path, lineage.abandon(self.path), "--overwrite starts over"))
        lineage.new_run_id(self.path)
        return notes

    def abandon_after(self, step: int) -> list[str]:
        """A run resumed at `step`: move its newer checkpoints aside (rank 0); returns notes."""
        if not self.primary:
            return []
        moved = lineage.abandon(self.path, newer_than=step)
        return [lineage.abandoned_note(self.path, moved, f"newer than step {step}, which the run resumed "
                                       "from")] if moved else []

    def write_config(self, run: RunConfig) -> None:
        """Write the resolved config durably (temp file, fsync, rename); rank 0 only. Paths inside
        the run directory are written relative to it."""
        if not self.primary:
            return
        saved = copy.copy(run)
        saved.engine = copy.copy(run.engine)
        saved.engine.nvme_path = [self._stored_path(p) for p in run.engine.nvme_path]
        try:
            write_small_durable(self.path / CONFIG_NAME, to_toml(saved).encode())
        except OSError as e:
            raise RunDirError(f"cannot write {self.path / CONFIG_NAME} ({e.strerror}); make the run "
                              "directory writable") from None

    def _stored_path(self, path: str) -> str:
        here, root = os.path.abspath(path), os.path.abspath(self.path)
        return os.path.relpath(here, root) if os.path.commonpath([here, root]) == root else here

    def log(self, record: dict[str, Any]) -> None:
        if not self.primary:
            return
        assert self._metrics is not None, "RunDir.open() first"
        self._metrics.write(json.dumps({**record, "time": time.time()}) + "\n")

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> RunDir:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def refuse_fresh_start(path: str | os.PathLike, steps: list[int]) -> str:
    """Why a fresh run may not start in a directory that holds checkpoints, and what to do."""
    return (f"run directory '{path}' already holds checkpoints (steps {', '.join(map(str, steps))}); "
            "continue it with --resume, or start over with --overwrite (which moves them into "
            "checkpoints/abandoned/)")


def rebase_paths(paths: list[str], run_dir: str | os.PathLike) -> list[str]:
    """Paths read from a run's own config.toml: relative ones are relative to the run directory."""
    return [p if os.path.isabs(p) else os.path.join(run_dir, p) for p in paths]


def enclosing_run_dir(path: str | os.PathLike) -> Path | None:
    """The run directory that `path` lies inside (a checkpoint, the store), or None."""
    here = Path(os.path.abspath(path))
    for parent in here.parents:
        if (parent / CONFIG_NAME).is_file() and ((parent / "checkpoints").is_dir()
                                                 or (parent / "metrics.jsonl").is_file()):
            return parent
    return None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl (a torn line from a kill is skipped). A resume
    marker drops the records of the steps after its checkpoint, which the resumed run redid."""
    records: list[dict[str, Any]] = []
    for line in Path(path, "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "resumed_at" in record:
            records = [r for r in records if r.get("step", 0) <= record["resumed_at"]]
            continue
        records.append(record)
    return records
