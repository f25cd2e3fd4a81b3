"""Checkpoints of a run directory: finding, verifying and pruning them.

`RUN_DIR/checkpoints/step-<N>/` holds a manifest and frozen arrays (see
`tierzero.checkpoint.manifest`). A directory only gets its final name once everything in it is
durable, so a `step-<N>` without a readable manifest, or with an array that fails its checksums, is
damage: it is skipped with a message naming the file, and the next older one is used. So is a
manifest that fails its own checksum or whose steps disagree (`Manifest.load`).

Pruning follows lineage (`tierzero.checkpoint.lineage`): it removes only checkpoints that the
run which just wrote one wrote itself, older than that one; anything else is left alone. And
of such a checkpoint it deletes only the files its manifest lists: anything else found in it
(another run's directory, a user's file) is moved into `checkpoints/abandoned/`, with a note.
The run's best checkpoint (`--keep-best`: the lowest evaluation loss, named with its run id in
`RUN_DIR/best.json`) is never pruned.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

from tierzero.checkpoint.files import is_regular
from tierzero.checkpoint.manifest import MANIFEST_NAME, STEP_DIR, Manifest
from tierzero.errors import CheckpointError, RunDirError
from tierzero.storage.base import StorageError
from tierzero.storage.durable import fsync_path, write_atomic
from tierzero.storage.filekind import kind_of
from tierzero.storage.nvme.arrays import chunk_path, verify_array

CHECKPOINTS_DIR = "checkpoints"
BEST_NAME = "best.json"  # in the run directory: its checkpoint of the lowest evaluation loss
ABANDONED_DIR = "abandoned"


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"step-{step:08d}"


def checkpoint_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every `step-<N>` directory of the run, oldest first (complete or not)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()
    ]
    return sorted(found)


def verify_checkpoint(path: Path, manifest: Manifest, rank: int | None = None) -> None:
    """Read every chunk of every array (or only `rank`'s) and check it against the manifest
    (names the file)."""
    for key, meta in manifest.arrays.items():
        if rank is not None and key.split("/")[2:3] != [f"r{rank}"]:
            continue  # another rank's shard: that rank checks it
        array = str(manifest.array_dir(path, key))
        odd = next(
            (
                c
                for i in range(meta.nchunks)
                if not is_regular(c := chunk_path(array, i)) and os.path.lexists(c)
            ),
            None,
        )
        if odd is not None:  # a FIFO would block the read below forever
            raise CheckpointError(f"checkpoint {path.name} is damaged: {odd} is not a regular file")
        try:
            verify_array(array, meta)
        except StorageError as e:
            raise CheckpointError(f"checkpoint {path.name} is damaged: {e}") from None


def newest_checkpoint(
    run_dir: str | Path,
    verify: bool = True,
    rank: int | None = None,
    all_ok: Callable[[bool], bool] | None = None,
) -> tuple[Path, Manifest, list[str]] | None:
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
    raise CheckpointError(
        f"no intact checkpoint is left ({'; '.join(skipped)}); start the run again "
        "without --resume or restore the files"
    )


def find_checkpoint(
    run_dir: str | Path, step: int | None = None, verify: bool = False
) -> tuple[Path, Manifest, list[str]]:
    """The checkpoint at `step`, or the newest complete one, and why newer ones were skipped (for
    export and inspect)."""
    if not Path(run_dir).is_dir():
        kind = kind_of(run_dir)
        raise CheckpointError(
            f"run directory '{run_dir}' "
            + (f"is {kind}, not a directory" if kind else "does not exist")
            + "; pass the directory of a run"
        )
    if step is not None:
        path = step_dir(run_dir, step)
        if not path.is_dir():
            have = ", ".join(str(s) for s, _ in checkpoint_dirs(run_dir)) or "none"
            raise CheckpointError(
                f"run '{run_dir}' has no checkpoint at step {step} (steps: {have}); "
                "pick one of those"
            )
        manifest = Manifest.load(path)
        if verify:
            verify_checkpoint(path, manifest)
        return path, manifest, []
    found = newest_checkpoint(run_dir, verify=verify)
    if found is None:
        raise CheckpointError(
            f"run '{run_dir}' has no complete checkpoint yet; train with "
            "--checkpoint-every N (a run also checkpoints when it finishes, but one "
            "with --offload none, the in-memory reference trainer, keeps none)"
        )
    return found


def prune(run_dir: str | Path, keep: int, written: Path) -> list[str]:
    """After `written` was made, keep it and the newest `keep - 1` older checkpoints of its
    lineage; remove that lineage's older ones; returns what to tell the user. Another run's
    checkpoints, newer ones, and ones whose manifest cannot be read (their lineage unknown) are
    never removed.

    Only the files a removed checkpoint's manifest lists are deleted: the live store's chunks
    that it linked keep their other name, so pruning never touches the live store.
    """
    newest = Manifest.load(written)
    best = read_best(run_dir)
    kept = best["step"] if best is not None and best["run_id"] == newest.origin.run_id else None
    ours = []
    for step, path in checkpoint_dirs(run_dir):
        if step >= newest.step or step == kept:
            continue
        try:
            manifest = Manifest.load(path)
        except CheckpointError:
            continue  # damaged or incomplete: not ours to delete
        if manifest.origin.run_id == newest.origin.run_id:
            ours.append((path, manifest))
    notes = []
    for path, manifest in ours[: max(len(ours) - (max(keep, 1) - 1), 0)]:
        if _remove_listed(path, manifest):
            target = move_aside(run_dir, path)
            notes.append(
                f"pruning checkpoint {path.name} found files its manifest does not list; they "
                f"were moved into {target}, not deleted: delete them there once no longer wanted"
            )
    return notes


def record_best(run_dir: str | Path, step: int, eval_loss: float) -> dict[str, object]:
    """Name checkpoint `step` (written already) the run's best, with its evaluation loss, in
    `RUN_DIR/best.json` (temp file, then rename); the record."""
    path = step_dir(run_dir, step)
    record = {
        "step": step,
        "eval_loss": eval_loss,
        "checkpoint": f"{CHECKPOINTS_DIR}/{path.name}",
        "run_id": Manifest.load(path).origin.run_id,
    }
    write_atomic(Path(run_dir) / BEST_NAME, (json.dumps(record, indent=1) + "\n").encode())
    return record


def read_best(run_dir: str | Path) -> dict[str, object] | None:
    """The run's best checkpoint as `record_best` wrote it, if it still exists (None: none, or
    a file that is not such a record)."""
    path = Path(run_dir) / BEST_NAME
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("step"), int)
        or not isinstance(record.get("run_id"), str)
        or not isinstance(record.get("eval_loss"), float)
        or not math.isfinite(record["eval_loss"])
    ):
        return None
    return record if step_dir(run_dir, record["step"]).is_dir() else None


def _remove_listed(path: Path, manifest: Manifest) -> bool:
    """Delete the files of checkpoint `path` that `manifest` lists, then its emptied folders;
    whether anything else is left in it."""
    listed = [path / MANIFEST_NAME]
    for key, meta in manifest.arrays.items():
        array = manifest.array_dir(path, key)
        listed += [
            array / "zarr.json",
            *(Path(chunk_path(str(array), i)) for i in range(meta.nchunks)),
        ]
    for file in listed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file)
    for folder, _, _ in os.walk(path, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # only an empty folder goes: what is left was not listed
    return os.path.lexists(path)


def move_aside(run_dir: str | Path, path: Path) -> Path:
    """Move `path` (a checkpoint, or what else a run leaves) into `checkpoints/abandoned/`,
    durably, under its own name or a numbered one; returns where it went."""
    aside = checkpoints_root(run_dir) / ABANDONED_DIR
    target, n = aside / path.name, 1
    while os.path.lexists(target):
        target, n = aside / f"{path.name}.{n}", n + 1
    try:
        aside.mkdir(parents=True, exist_ok=True)
        os.rename(path, target)
    except OSError as e:
        raise RunDirError(
            f"cannot move {path} aside into {aside} ({e.strerror}); make the run directory writable"
        ) from None
    fsync_path(str(aside))
    fsync_path(str(path.parent))
    return target
