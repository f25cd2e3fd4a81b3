"""`ResultLog`: the benchmark's results, one JSON object a line, each on disk the moment it exists.

A benchmark on a machine it has never seen may be killed at any instant (a time limit, the out
of memory killer, a lost session), so nothing is kept in memory for a write at the end: every
record -- a measurement, a refusal, an error with its message -- is appended as one line and
flushed to the drive before the caller goes on. A line is written with one `write` of the whole
line, so a kill leaves whole lines; a reader skips only a torn last line (power loss).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class ResultLog:
    """Appends records to `path`; each carries the run's id, its sequence number and the
    seconds since the log was opened."""

    def __init__(self, path: Path, run: str) -> None:
        self.path = path
        self.run = run
        self.seq = 0
        self._start = time.monotonic()
        self._fd: int | None = None
        self._lock = threading.Lock()  # the watchdog records from its own thread

    def open(self) -> ResultLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        return self

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ResultLog:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def append(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Write one record and make it durable; returns it."""
        assert self._fd is not None, "ResultLog used before open()"
        with self._lock:
            return self._append(kind, fields)

    def _append(self, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
        record = {
            "run": self.run,
            "seq": self.seq,
            "t_s": round(time.monotonic() - self._start, 3),
            "kind": kind,
            **fields,
        }
        line = (json.dumps(record, default=str) + "\n").encode()
        os.write(self._fd, line)  # O_APPEND: one write, one whole line
        os.fsync(self._fd)
        self.seq += 1
        return record


def read_results(path: Path, run: str | None = None) -> list[dict[str, Any]]:
    """The records in `path` (of one `run`, if given), skipping a torn last line."""
    records = []
    lines = path.read_text().splitlines() if path.exists() else []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise
        if run is None or record.get("run") == run:
            records.append(record)
    return records
