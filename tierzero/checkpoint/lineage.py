"""Lineage: which run wrote each checkpoint of a run directory, and moving checkpoints aside.

A run directory records one run id in `RUN_DIR/run-id`: written when a run starts fresh, kept
when it resumes. Every manifest records the run id that wrote it, so pruning removes only the
writing run's own older checkpoints, never another run's. Checkpoints that no longer lie on
the run's path -- newer than the one a resume continues from, or all of them when a fresh run
starts over with --overwrite -- are moved into `checkpoints/abandoned/`, never deleted: they
may be the only copy of someone's work. Moving is a rename within the directory (no bytes).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from tierzero.checkpoint.catalog import ABANDONED_DIR, checkpoint_dirs, checkpoints_root, move_aside
from tierzero.checkpoint.files import is_regular, read_regular
from tierzero.errors import RunDirError
from tierzero.storage.durable import write_atomic

RUN_ID_NAME = "run-id"


def read_run_id(run_dir: str | Path) -> str | None:
    """The run id the directory records, or None when it records none (or an unreadable one)."""
    try:
        text = read_regular(Path(run_dir) / RUN_ID_NAME, limit=256).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


def new_run_id(run_dir: str | Path) -> str:
    """Start a new lineage: a fresh id, written durably to `RUN_DIR/run-id`."""
    return write_run_id(run_dir, uuid.uuid4().hex)


def write_run_id(run_dir: str | Path, run_id: str) -> str:
    """Record `run_id` durably as the directory's lineage."""
    try:
        write_atomic(Path(run_dir) / RUN_ID_NAME, f"{run_id}\n".encode())
    except OSError as e:
        raise RunDirError(
            f"cannot write {Path(run_dir) / RUN_ID_NAME} ({e.strerror}); make the run "
            "directory writable"
        ) from None
    return run_id


def run_id(run_dir: str | Path) -> str:
    """The directory's run id, starting a lineage when it has none (a save through the API)."""
    return read_run_id(run_dir) or new_run_id(run_dir)


def stamp(checkpoint: Path) -> dict[str, Any]:
    """What a manifest of `RUN_DIR/checkpoints/<checkpoint>` records about its run: the run id
    and the run's config.toml as it is now (None when the run has none, as through the API)."""
    run_dir = checkpoint.parent.parent
    config = run_dir / "config.toml"
    return {
        "run_id": run_id(run_dir),
        "config_toml": read_regular(config).decode() if is_regular(config) else None,
    }


def abandon(run_dir: str | Path, newer_than: int | None = None) -> list[Path]:
    """Move the checkpoints of steps after `newer_than` (all, when None) into
    `checkpoints/abandoned/`; returns where they went. Same-named ones there are kept too."""
    return [
        move_aside(run_dir, path)
        for step, path in checkpoint_dirs(run_dir)
        if newer_than is None or step > newer_than
    ]


def abandoned_note(run_dir: str | Path, moved: list[Path], why: str) -> str:
    names = ", ".join(p.name for p in moved)
    return (
        f"moved checkpoint(s) {names} aside into {checkpoints_root(run_dir) / ABANDONED_DIR} "
        f"({why}); delete them there once they are no longer wanted"
    )
