"""Checkpoints of a run directory: finding, verifying and pruning them.

`RUN_DIR/checkpoints/step-<N>/` holds a manifest and frozen arrays (see `tierzero.checkpoint.manifest`).
A directory only gets its final name once everything in it is durable, so a `step-<N>`
without a readable manifest, or with an array that fails its checksums, is damage: it is
skipped with a message naming the file, and the next older one is used.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

from tierzero.errors import CheckpointError
from tierzero.checkpoint.manifest import Manifest
from tierzero.storage.arrays import verify_array
from tierzero.storage.base import StorageError

CHECKPOINTS_DIR = "checkpoints"
_STEP_DIR = re.compile(r"step-(\d+)")


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"step-{step:08d}"


def checkpoint_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every `step-<N>` directory of the run, oldest first (complete or not)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def verify_checkpoint(path: Path, manifest: Manifest, rank: int | None = None) -> None:
    """Read every chunk of every array (or only `rank`'s) and check it against the manifest
    (names the file)."""
    for key, meta in manifest.arrays.items():
        if rank is not None and key.split("/")[2:3] != [f"r{rank}"]:
            continue  # another rank's shard: that rank checks it
        try:
            verify_array(str(manifest.array_dir(path, key)), meta)
        except StorageError as e:
            raise CheckpointError(f"checkpoint {path.name} is damaged: {e}") from None


def newest_checkpoint(run_dir: str | Path, verify: bool = True, rank: int | None = None,
                      all_ok: Callable[[bool], bool] | None = None) -> tuple[Path, Manifest, list[str]] | None:
    """The newest complete (and, with `verify`, intact) checkpoint, and why newer ones were skipped.

    Several ranks: each checks only its own shards (`rank`) and `all_ok` (a collective) tells
    every rank whether all found theirs intact, so they agree on one checkpoint."""
    skipped: list[str] = []
    for _, path in reversed(checkpoint_dirs(run_dir)):
        why = None
        try:
            manifest = Manifest.load(path)
            if verify:
                verify_checkpoint(path, manifest, rank)
        except CheckpointError as e:
            why = str(e)
        if all_ok is not None and not all_ok(why is None) and why is None:
            why = "another rank found its part of it damaged"
        if why is not None:
            skipped.append(f"skipped checkpoint {path.name}: {why}")
            continue
        return path, manifest, skipped
    return None if not skipped else _none_left(skipped)


def _none_left(skipped: list[str]) -> None:
    raise CheckpointError(f"no intact checkpoint is left ({'; '.join(skipped)}); start the run again "
                          "without --resume or restore the files")


def find_checkpoint(run_dir: str | Path, step: int | None = None, verify: bool = False) -> tuple[Path, Manifest]:
    """The checkpoint at `step`, or the newest complete one (for export and inspect)."""
    if not Path(run_dir).is_dir():
        raise CheckpointError(f"run directory '{run_dir}' does not exist; pass the --run-dir of a run")
    if step is not None:
        path = step_dir(run_dir, step)
        if not path.is_dir():
            have = ", ".join(str(s) for s, _ in checkpoint_dirs(run_dir)) or "none"
            raise CheckpointError(f"run '{run_dir}' has no checkpoint at step {step} (steps: {have}); "
                                  "pick one of those")
        manifest = Manifest.load(path)
        if verify:
            verify_checkpoint(path, manifest)
        return path, manifest
    found = newest_checkpoint(run_dir, verify=verify)
    if found is None:
        raise CheckpointError(f"run '{run_dir}' has no complete checkpoint yet; train with "
                              "--checkpoint-every N (a run also checkpoints when it finishes)")
    return found[0], found[1]


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` complete checkpoints (and incomplete older ones).

    Only checkpoint directories are removed: the live store's chunks that a removed checkpoint
    linked keep their other name, so pruning never touches the live store.
    """
    dirs = checkpoint_dirs(run_dir)
    complete = [p for _, p in dirs if (p / "manifest.json").is_file()]
    kept = set(complete[-keep:]) if keep > 0 else set()
    newest_kept = max((s for s, p in dirs if p in kept), default=None)
    removed = []
    for s, p in dirs:
        if p in kept or (newest_kept is not None and s > newest_kept):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed
