"""The run directory: its lock, identity (config.toml, run-id), lineage, metrics and samples.

One trainer per directory: `open()` takes an exclusive, non-blocking `flock` on `lock`, so a
second trainer is refused at once (and a crashed one leaves no stale lock: the kernel drops it).
With several ranks the run is one trainer: rank 0 (`primary`) holds the lock and writes the
config and metrics; the other ranks only make sure the directory exists.

The run's identity comes first (`start`): its resolved config.toml, whose first line records the
run id, is written durably before `run-id`, the lock's pid or any move-aside, so no kill leaves a
directory that resumes with settings other than the ones it was started with. That write is an
`--overwrite`'s commit point: the old checkpoints are moved aside after it and `run-id` written
last, and a resume that finds config.toml naming another run id than `run-id` finishes the move
(`_finish_overwrite`). A kill at any instant leaves the old run, resumable as itself, or the new.

A run directory is never inside another run's checkpoints/ nor inside an NVMe store (a prune or
a store's start-up cleanup would delete it), never something other than a directory, and never
read-only for a trainer; each is refused in one sentence before anything is written.

Paths in config.toml that lie inside the run directory (the default `nvme`) are stored relative
to it, and read back against it (`rebase_paths`), so a copied or moved run directory resumes
against its own store, from any working directory. Paths outside it are stored absolute.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierzero.checkpoint import lineage
from tierzero.checkpoint.catalog import CHECKPOINTS_DIR, checkpoint_dirs, move_aside
from tierzero.checkpoint.files import read_regular
from tierzero.config import FormatSettings, RunConfig
from tierzero.configfile import read_toml, to_toml
from tierzero.errors import ConfigError, RunDirError
from tierzero.storage.durable import write_atomic
from tierzero.storage.filekind import kind_of, not_a_file, open_regular
from tierzero.storage.nvme.dirlock import is_store_root, try_lock

CONFIG_NAME = "config.toml"
METRICS_NAME = "metrics.jsonl"
SAMPLES_NAME = "samples.jsonl"  # generations during training (`tierzero.run.samples`)
LOCK_NAME = "lock"
_RUN_ID_LINE = re.compile(r"# run-id: ([0-9a-f]+)")
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


class RunDir:
    def __init__(self, path: str | os.PathLike, primary: bool = True) -> None:
        self.path = Path(path)
        self.primary = primary
        self.run_id: str | None = None
        self._lock_fd: int | None = None
        self._metrics = None
        self._stream: Callable[[dict[str, Any]], None] | None = None
        self._sample_stream: Callable[[int, list[dict[str, Any]]], None] | None = None

    def open(self) -> RunDir:
        """Create the directory if need be and take its lock; writes nothing else."""
        check_place(self.path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(
                f"cannot create run directory '{self.path}' ({e.strerror}); "
                "choose a writable --run-dir"
            ) from None
        if not self.primary:
            return self
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise RunDirError(read_only(self.path))
        try:
            fd = open_regular(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise RunDirError(
                read_only(self.path)
                if e.errno in _READ_ONLY
                else f"cannot open {self.path / LOCK_NAME} ({e.strerror}); remove it"
            ) from None
        owner = try_lock(fd)
        if owner is not None:
            raise RunDirError(
                f"run directory '{self.path}' is in use by another trainer (pid {owner}); "
                "wait for it to finish or choose another --run-dir"
            )
        self._lock_fd = fd
        return self

    def start(self, run: RunConfig, resume: bool, overwrite: bool = False) -> list[str]:
        """Begin or continue this directory's lineage (rank 0; under the lock); returns notes.

        A fresh run into a directory holding checkpoints is refused unless `overwrite`, which
        moves them aside into checkpoints/abandoned/ once the new config (and its run id) is
        durable; a resumed one keeps its run id (see the module docstring for the order)."""
        if not self.primary:
            return []
        names = (CONFIG_NAME, lineage.RUN_ID_NAME, METRICS_NAME, SAMPLES_NAME)
        for name in names:  # before anything is written
            if (why := not_a_file(self.path / name)) is not None:
                raise RunDirError(f"{why}; remove it, or choose another --run-dir")
        notes: list[str] = []
        if resume:
            refuse_other_state_format(self.path, run)
            self.run_id = config_run_id(self.path) or lineage.run_id(self.path)
            notes = self._finish_overwrite()
        else:
            steps = [s for s, _ in checkpoint_dirs(self.path)]
            if steps and not overwrite:
                raise RunDirError(refuse_fresh_start(self.path, steps))
            self.run_id = uuid.uuid4().hex
            self.write_config(run)  # the commit point of a new run, and of an --overwrite
            notes = self._move_old_run_aside("--overwrite starts over")
            lineage.write_run_id(self.path, self.run_id)
        self._write_pid()
        return notes

    def _finish_overwrite(self) -> list[str]:
        """A resume after an --overwrite stopped between its config and its run id: the config
        names the new run, so the old run's checkpoints go aside and run-id follows."""
        if lineage.read_run_id(self.path) == self.run_id:
            return []
        notes = self._move_old_run_aside(
            "an --overwrite that was stopped before it finished started over"
        )
        lineage.write_run_id(self.path, self.run_id)
        return notes

    def _move_old_run_aside(self, why: str) -> list[str]:
        moved = lineage.abandon(self.path)
        metrics = self.path / METRICS_NAME
        if moved and os.path.isfile(metrics):  # the old run's metrics belong with its checkpoints
            move_aside(self.path, metrics)
        return [lineage.abandoned_note(self.path, moved, why)] if moved else []

    def _write_pid(self) -> None:
        assert self._lock_fd is not None, "RunDir.open() first"
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)

    def abandon_after(self, step: int) -> list[str]:
        """A run resumed at `step`: move its newer checkpoints aside (rank 0); returns notes."""
        if not self.primary:
            return []
        moved = lineage.abandon(self.path, newer_than=step)
        return (
            [
                lineage.abandoned_note(
                    self.path, moved, f"newer than step {step}, which the run resumed from"
                )
            ]
            if moved
            else []
        )

    def write_config(self, run: RunConfig) -> None:
        """Write the resolved config durably (temp file, fsync, rename, directory fsync), its
        first line naming the run id; rank 0 only. Paths inside the run directory are written
        relative to it."""
        if not self.primary:
            return
        assert self.run_id is not None, "RunDir.start() first"
        saved = run.replace(nvme_path=[self._stored_path(p) for p in run.engine.tiering.nvme_path])
        text = f"# run-id: {self.run_id}\n{to_toml(saved)}"
        try:
            write_atomic(self.path / CONFIG_NAME, text.encode())
        except OSError as e:
            raise RunDirError(
                f"cannot write {self.path / CONFIG_NAME} ({e.strerror}); make the run "
                "directory writable"
            ) from None

    def _stored_path(self, path: str) -> str:
        here, root = os.path.abspath(path), os.path.abspath(self.path)
        return os.path.relpath(here, root) if os.path.commonpath([here, root]) == root else here

    def open_metrics(self, start_step: int) -> None:
        """Open metrics.jsonl for appending, after dropping the rows of steps after `start_step`
        (a resume redoes them: their rows are replaced, not repeated; a new run keeps none)."""
        if not self.primary:
            return
        path = self.path / METRICS_NAME
        try:
            lines = _metrics_lines(path)
            kept = [line for line in lines if _before(line, start_step)]
            if len(kept) < len(lines):
                write_atomic(path, "".join(f"{line}\n" for line in kept).encode())
            self._keep_samples_through(start_step)  # samples.jsonl: the same rule
            fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as e:
            raise RunDirError(
                f"cannot write {path} ({e.strerror}); remove it or choose another --run-dir"
            ) from None
        self._metrics = os.fdopen(fd, "a", buffering=1)

    def log(self, record: dict[str, Any]) -> None:
        if not self.primary:
            return
        assert self._metrics is not None, "RunDir.open_metrics() first"
        record = {**record, "time": time.time()}
        self._metrics.write(json.dumps(record) + "\n")
        if self._stream is not None:
            self._stream(record)

    def stream_metrics(self, to: Callable[[dict[str, Any]], None] | None) -> None:
        """Hand every record written to metrics.jsonl, once written, to `to` as well (the run's
        experiment trackers, `tierzero.run.trackers`); None stops."""
        self._stream = to

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Append step `step`'s samples (`tierzero.run.samples`: one row per prompt) to
        samples.jsonl and fsync it (a kill leaves whole rows and at most a torn last line, which
        readers skip), then hand them to `stream_samples`' receiver; rank 0 only."""
        if not self.primary:
            return
        stamp = time.time()
        text = "".join(json.dumps({**row, "time": stamp}) + "\n" for row in rows).encode()
        path = self.path / SAMPLES_NAME
        try:
            with os.fdopen(open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise RunDirError(
                f"cannot write {path} ({e.strerror}); remove it or choose another --run-dir"
            ) from None
        if self._sample_stream is not None:
            self._sample_stream(step, rows)

    def stream_samples(self, to: Callable[[int, list[dict[str, Any]]], None] | None) -> None:
        """Hand each step's samples, once written to samples.jsonl, to `to(step, rows)` as well
        (the run's experiment trackers); None stops."""
        self._sample_stream = to

    def _keep_samples_through(self, step: int) -> None:
        """Drop samples.jsonl's rows of steps after `step` (a resume redoes them; a new run
        keeps none)."""
        path = self.path / SAMPLES_NAME
        lines = _metrics_lines(path)
        kept = [line for line in lines if _before(line, step)]
        if len(kept) < len(lines):
            write_atomic(path, "".join(f"{line}\n" for line in kept).encode())

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


def check_place(path: str | os.PathLike) -> None:
    """Refuse a run directory that is not a directory, or that lies inside another run's
    checkpoints/ or inside an NVMe store (whose pruning or cleanup would delete it)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise RunDirError(
            f"run directory '{path}' is {kind_of(path)}, not a directory; pass the path of a "
            "directory (or of none yet) as --run-dir"
        )
    here = Path(os.path.realpath(path))
    for parent in [here, *here.parents]:
        if is_store_root(parent):
            raise RunDirError(
                f"run directory '{path}' lies inside the NVMe store directory {parent}, whose "
                "start-up cleanup would delete it; choose a --run-dir outside it"
            )
        if parent.name == CHECKPOINTS_DIR and _looks_like_run(parent.parent) and parent != here:
            raise RunDirError(
                f"run directory '{path}' lies inside the checkpoints of the run directory "
                f"{parent.parent}, whose pruning would delete it; choose a --run-dir outside it"
            )


def _looks_like_run(path: Path) -> bool:
    return any(
        os.path.lexists(path / name) for name in (CONFIG_NAME, lineage.RUN_ID_NAME, LOCK_NAME)
    )


def read_only(path: str | os.PathLike) -> str:
    return (
        f"run directory '{path}' is read-only, and a trainer writes its lock, config, metrics and "
        "checkpoints there; make it writable or copy the run to a writable --run-dir (inspect and "
        "export read it as it is)"
    )


def never_configured(path: str | os.PathLike) -> str | None:
    """Why `--resume` must refuse `path`: a run was started there (its lock, run id, metrics or
    checkpoints exist) but its config.toml was never written; None when it has one, or nothing."""
    if os.path.lexists(Path(path) / CONFIG_NAME):
        return None
    started = [
        n
        for n in (lineage.RUN_ID_NAME, LOCK_NAME, METRICS_NAME, CHECKPOINTS_DIR)
        if os.path.lexists(Path(path) / n)
    ]
    if checkpoint_dirs(path):
        return (
            f"run directory '{path}' holds checkpoints but no {CONFIG_NAME}: restore it (every "
            "checkpoint's manifest.json records it as config_toml), or start over with --overwrite"
        )
    if not started:
        return None
    return (
        f"run directory '{path}' was started but never configured (it has "
        f"{', '.join(started)} but no {CONFIG_NAME}): start it again with --overwrite"
    )


def config_run_id(run_dir: str | os.PathLike) -> str | None:
    """The run id a run's config.toml records on its first line (None: none, or no config)."""
    try:
        first = read_regular(Path(run_dir) / CONFIG_NAME).decode(errors="replace").split("\n", 1)[0]
    except OSError:
        return None
    match = _RUN_ID_LINE.fullmatch(first.strip())
    return match.group(1) if match else None


def _metrics_lines(path: Path) -> list[str]:
    if not os.path.lexists(path):
        return []
    return read_regular(path).decode(errors="replace").splitlines()


def _before(line: str, start_step: int) -> bool:
    """Whether a metrics row stays when a run (re)starts at `start_step` (torn lines do not)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    if start_step == 0 or not isinstance(record, dict):
        return False
    return record.get("step", record.get("resumed_at", 0)) <= start_step


def refuse_fresh_start(path: str | os.PathLike, steps: list[int]) -> str:
    """Why a fresh run may not start in a directory that holds checkpoints, and what to do."""
    return (
        f"run directory '{path}' already holds checkpoints (steps {', '.join(map(str, steps))}); "
        "continue it with --resume, or start over with --overwrite (which moves them into "
        "checkpoints/abandoned/)"
    )


def rebase_paths(paths: list[str], run_dir: str | os.PathLike) -> list[str]:
    """Paths read from a run's own config.toml: relative ones are relative to the run directory."""
    return [p if os.path.isabs(p) else os.path.join(run_dir, p) for p in paths]


def enclosing_run_dir(path: str | os.PathLike) -> Path | None:
    """The run directory that `path` lies inside (a checkpoint, the store), or None."""
    here = Path(os.path.abspath(path))
    for parent in here.parents:
        if (parent / CONFIG_NAME).is_file() and (
            (parent / "checkpoints").is_dir() or (parent / "metrics.jsonl").is_file()
        ):
            return parent
    return None


def read_samples(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a run's samples.jsonl (none when it has none; a torn last line is skipped)."""
    rows = []
    for line in _metrics_lines(Path(path, SAMPLES_NAME)):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl (a torn line from a kill is skipped). A resume
    marker drops the records of the steps after its checkpoint, which the resumed run redid."""
    records: list[dict[str, Any]] = []
    metrics = Path(path, METRICS_NAME)
    try:
        text = read_regular(metrics).decode(errors="replace")
    except OSError as e:
        raise RunDirError(
            f"cannot read {metrics} ({e.strerror}); point at a run directory that "
            "`tierzero train` wrote"
        ) from None
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "resumed_at" in record:
            records = [r for r in records if r.get("step", 0) <= record["resumed_at"]]
            continue
        records.append(record)
    return records


# the state formats a run's checkpoints are written in: fixed for the run's life
_STATE_FORMAT_FLAGS = {
    "optimizer_state": ("--optimizer-state", "Adam moments"),
    "master": ("--master", "master weights"),
}


def refuse_other_state_format(path: Path, run: RunConfig) -> None:
    """A resume whose --optimizer-state or --master differs from the run's config.toml (where
    it has checkpoints, which hold the state in the saved format) is refused, naming the flag
    that matches. A config.toml from before these keys holds fp32 state."""
    saved_path = path / CONFIG_NAME
    if not checkpoint_dirs(path) or not saved_path.is_file():
        return
    saved = read_toml(saved_path)
    for key, (flag, what) in _STATE_FORMAT_FLAGS.items():
        was, now = (
            str(saved.get(key, getattr(FormatSettings, key).value)).lower(),
            getattr(run.engine.formats, key).value,
        )
        if now != was:
            raise ConfigError(
                f"{flag} {now} differs from the {was} this run's checkpoints hold its {what} in; "
                f"resume with {flag} {was}, or start a new run with --overwrite to change it"
            )
