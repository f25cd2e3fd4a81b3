"""The run directory: its lock, its resolved `config.toml` and its `metrics.jsonl`.

One trainer per directory: `open()` takes an exclusive, non-blocking `flock` on `lock`, so a
second trainer is refused at once (and a crashed one leaves no stale lock: the kernel drops it).
With several ranks the run is one trainer: rank 0 (`primary`) holds the lock and writes the
config and metrics; the other ranks only make sure the directory exists.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from tierzero.config import RunConfig, to_toml
from tierzero.errors import RunDirError


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

    def write_config(self, run: RunConfig) -> None:
        """Write the resolved config atomically (temp file, then rename); rank 0 only."""
        if not self.primary:
            return
        tmp = self.path / "config.toml.tmp"
        tmp.write_text(to_toml(run))
        os.replace(tmp, self.path / "config.toml")

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
