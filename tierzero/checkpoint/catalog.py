"""Checkpoints of a run directory: finding, verifying and pruning them.

`RUN_DIR/checkpoints/step-<N>/` holds a manifest and frozen arrays (see `tierzero.checkpoint.manifest`).
A directory only gets its final name once everything in it is durable, so a `step-<N>`
without a readable manifest, or with an array that fails its checksums, is damage: it is
skipped with a message naming the file, and the next older one is used. So is a manifest that
fails its own checksum or whose steps disagree (`Manifest.load`).

Pruning follows lineage (`tierzero.checkpoint.lineage`): it removes only checkpoints that the
run which just wrote one wrote itself, older than that one; anything else is left alone.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from tierzero.errors import CheckpointError
from tierzero.checkpoint.files import is_regular
from tierzero.checkpoint.manifest import STEP_DIR, Manifest
from tierzero.storage.arrays import chunk_path, verify_array
from tierzero.storage.base import StorageError

CHECKPOINTS_DIR = "checkpoints"


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"step-{step:08d}"


def checkpoint_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every `step-<N>` directory of the run, oldest first (complete or not)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def verify_checkpoint(path: Path, manifest: Manifest, rank: int | None = None) -> None:
    """Read every chunk of every array (or only `rank`'s) and check it against the manifest
    (names the file)."""
    for key, meta in manifest.arrays.items():
        if rank is not None and key.split("/")[2:3] != [f"r{rank}"]:
            continue  # another rank's shard: that rank checks it
        array = str(manifest.array_dir(path, key))
        odd = next((c for i in range(meta.nchunks) if not is_regular(c := chunk_path(array, i))
                    and os.path.lexists(c)), None)
        if odd is not None:  # a FIFO would block the read below forever
            raise CheckpointError(f"checkpoint {path.name} is damaged: {odd} is not a regular file")
        try:
            verify_array(array, meta)
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


def prune(run_dir: str | Path, keep: int, written: Path) -> list[Path]:
    """After `written` was made, keep it and the newest `keep - 1` older checkpoints of its
    lineage; remove that lineage's older ones. Another run's checkpoints, newer ones, and ones
    whose manifest cannot be read (their lineage unknown) are never removed.

    Only checkpoint directories are removed: the live store's chunks that a removed checkpoint
    linked keep their other name, so pruning never touches the live store.
    """
    newest = Manifest.load(written)
    ours = []
    for step, path in checkpoint_dirs(run_dir):
        if step >= newest.step:
            continue
        try:
            if Manifest.load(path).run_id == newest.run_id:
                ours.append(path)
        except CheckpointError:
            continue  # damaged or incomplete: not ours to delete
    removed = ours[:max(len(ours) - (max(keep, 1) - 1), 0)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
