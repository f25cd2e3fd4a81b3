"""Taking a checkpoint of an engine, and restoring one into it.

Saving (at an optimizer-step boundary): finish every transfer, flush the NVMe store (so the
chunks about to be linked are durable), then build `checkpoints/.step-<N>.tmp-<pid>/`:
NVMe-homed shards are hard-linked from the store's current generations (metadata, no bytes),
memory-homed shards are written out; then the filesystem is synced, `manifest.json` is written
and fsynced, and the directory is renamed to `step-<N>` -- the checkpoint's commit point --
and `checkpoints/` fsynced (tests/checkpoint/test_save_order.py records that order). A
kill at any instant leaves either no `step-<N>` or a complete one; temp directories are
removed at the next save. The store never overwrites a linked chunk (see `storage.nvme.spares`).

Restoring: the checkpoint's arrays are verified against the manifest's checksums (by the
caller), NVMe-homed shards become the store's new current generations by hard links
(`NvmeStore.adopt`, no bytes copied), memory-homed ones are read in; then the counters, loss
scaler, clipping norm and RNG states are set, so the next step is bitwise the one an
uninterrupted run would take (per-parameter step counts included, for parameters that missed
steps). Gradients are not saved: a checkpoint sits between steps, where every grad shard is
overwritten before it is read. Frozen parameters are saved as params only.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import torch

from tierzero.checkpoint import lineage
from tierzero.checkpoint.catalog import (
    checkpoints_root,
    newest_checkpoint,
    prune,
    step_dir,
    verify_checkpoint,
)
from tierzero.checkpoint.manifest import MANIFEST_NAME, Manifest, Origin, config_hash, layout_of
from tierzero.compact.formats import INT8_CODES
from tierzero.config import STATE_BLOCK, Config, StateKind, Tier
from tierzero.distributed.comm import Comm
from tierzero.engine.parts import EngineParts
from tierzero.engine.runtime.binding import detach_params
from tierzero.errors import CheckpointError, TierzeroError
from tierzero.models.nf4_shard import recorded_weights
from tierzero.storage.base import dtype_name, os_error
from tierzero.storage.durable import fsync_path
from tierzero.storage.io import write_durable
from tierzero.storage.nvme import chunkfile
from tierzero.storage.nvme.arrays import read_array, write_array
from tierzero.storage.nvme.zarrmeta import ShardMeta

SAVED_KINDS = (StateKind.PARAM, StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
# Config fields that change what a step computes; a resumed run with others differs.
_NUMERIC_FIELDS = (
    "dtype",
    "lr",
    "weight_decay",
    "betas",
    "eps",
    "lr_schedule",
    "warmup_steps",
    "total_steps",
    "min_lr_ratio",
    "clip_grad_norm",
    "clip_previous_norm",
    "accumulate",
    "loss_scale",
    "loss_scale_window",
    "seed",
    "grad_reduce_dtype",
)


def numeric_config_hash(config: Config) -> str:
    flat = config.flat()
    return config_hash({f: flat[f] for f in _NUMERIC_FIELDS})


def save(
    engine: EngineParts,
    run_dir: str | Path,
    data: dict[str, Any] | None = None,
    keep: int | None = None,
    model: dict[str, Any] | None = None,
) -> Path:
    """Write `run_dir/checkpoints/step-<N>` for the engine's current step; returns its path.

    With several ranks it is a collective and they make one checkpoint: rank 0 names the temp
    directory, every rank puts its own shards into it and syncs them, and rank 0 writes the one
    manifest (every rank's arrays and RNG state, the world size) and renames the directory into
    place once all have. A rank that fails leaves no `step-<N>`: the last complete one stays.
    """
    comm = engine.layout.comm
    accumulate, state = engine.config.execution.accumulate, engine.counters.state
    if not state.between_steps(accumulate):
        raise TierzeroError(
            f"a checkpoint needs a finished optimizer step, but {state.micro % accumulate} "
            f"of {accumulate} micro-batches are accumulated; save after step()"
        )
    tiers = engine.tiers
    tiers.pending.drain()
    nvme = tiers.stores.get(Tier.NVME)
    if nvme is not None:
        tiers.run(nvme.flush())  # linked chunks must be durable before a manifest names them
    root = checkpoints_root(run_dir)
    final = step_dir(run_dir, engine.counters.state.step_count)
    if comm.rank == 0:
        _prepare_root(root)
    temp = root / comm.broadcast_json(f".{final.name}.tmp-{os.getpid()}")
    committed = False
    try:
        arrays, copied = _write_shards(engine, temp)
        chunkfile.sync_filesystem(str(temp))  # the links and directories, before the manifest
        parts = comm.all_gather_json(
            {
                "arrays": {k: m.to_dict() for k, m in arrays.items()},
                "copied": copied,
                "rng": _rng_state(engine.device),
            }
        )
        error = None
        if comm.rank == 0:
            try:
                _commit(engine, temp, final, parts, data, model)
                committed = True
            except Exception as e:
                if comm.world_size == 1:
                    raise  # its own sentence (the caller's ENOSPC names the file)
                error = str(e)
        error = comm.broadcast_json(error)
        if error is not None:
            raise CheckpointError(
                f"rank 0 could not commit checkpoint {final.name} ({error}); the last "
                "complete checkpoint stays"
            )
    except BaseException:
        if not committed:
            shutil.rmtree(temp, ignore_errors=True)
        raise
    copied = sum(p["copied"] for p in parts)
    if (
        copied
        and nvme is not None
        and any(engine.layout.placement.home(k) is Tier.NVME for k in SAVED_KINDS)
    ):
        engine.note(
            "checkpoints copy the NVMe state's chunks because the run directory is on another "
            "filesystem than --nvme-path; keep them on one filesystem for checkpoints that copy "
            "nothing"
        )
    if keep is not None and comm.rank == 0:
        for note in prune(run_dir, keep, final):  # this lineage's older checkpoints only
            engine.note(note)
    comm.barrier()  # every rank returns once the checkpoint is in place (and pruned)
    return final


def _write_shards(engine: EngineParts, temp: Path) -> tuple[dict[str, ShardMeta], int]:
    """This rank's saved shards under `temp/state`: NVMe-homed ones linked, others written."""
    tiers, nvme = engine.tiers, engine.tiers.stores.get(Tier.NVME)
    arrays, copied = {}, 0
    for unit in engine.layout.units:
        for kind in SAVED_KINDS:
            for key, a, b in engine.shards.keys(kind, unit):
                dst = str(temp / "state" / Path(*key.split("/")))
                if engine.layout.placement.home(kind) is Tier.NVME:
                    # verified reads: a chunk written since its last read is checked before it is
                    # linked
                    arrays[key], nbytes = tiers.run(
                        nvme.freeze(key, dst, sync=False, verify=bool(nvme.verify_reads))
                    )
                    copied += nbytes
                else:
                    part = engine.shards.empty(kind, b - a)  # in its stored format
                    engine.shards.read_key(kind, key, part)
                    arrays[key] = write_array(
                        dst,
                        part,
                        engine.config.streaming.chunk_bytes,
                        engine.shards.formats.layout(key, part),
                    )
                    copied += part.numel() * part.element_size()
    return arrays, copied


def _commit(
    engine: EngineParts,
    temp: Path,
    final: Path,
    parts: list[dict[str, Any]],
    data: dict[str, Any] | None,
    model: dict[str, Any] | None,
) -> None:
    """Rank 0: write the one manifest naming every rank's arrays, then rename into place."""
    arrays = {
        k: ShardMeta.from_dict(m, f"rank {r}'s array {k!r}")
        for r, part in enumerate(parts)
        for k, m in part["arrays"].items()
    }
    rank_rng = [p["rng"] for p in parts] if len(parts) > 1 else None
    copied = sum(p["copied"] for p in parts)
    origin = Origin(time.time(), model=model, bytes_copied=copied, **lineage.stamp(final))
    manifest = Manifest(
        step=engine.counters.state.step_count,
        world_size=engine.layout.comm.world_size,
        compute_dtype=dtype_name(engine.layout.dtype),
        config_hash=numeric_config_hash(engine.config),
        units=layout_of(engine.layout.units),
        arrays=arrays,
        origin=origin,
        engine=_engine_state(engine),
        data=data,
        rng=parts[0]["rng"],
        rank_rng=rank_rng,
        stage=engine.layout.stage,
    )
    engine.tiers.run(write_durable(str(temp / MANIFEST_NAME), manifest.to_json()))
    try:
        _replace_dir(temp, final)
    except OSError as e:
        raise os_error(e, "committing checkpoint", str(final)) from e


def find(path: Path, comm: Comm, note: Callable[[str], None]) -> tuple[Path, Manifest]:
    """The checkpoint to resume from, verified: `path` itself (a `step-<N>` directory), or a run
    directory's newest intact one (damaged newer ones are skipped, and `note`d)."""
    rank = comm.rank if comm.world_size > 1 else None  # each rank checks its own shards
    if (path / MANIFEST_NAME).exists():
        manifest = Manifest.load(path)
        verify_checkpoint(path, manifest, rank)
        return path, manifest
    found = newest_checkpoint(path, rank=rank, all_ok=comm.all_ok if rank is not None else None)
    if found is None:
        raise CheckpointError(
            f"'{path}' holds no checkpoint; pass a run directory with "
            "checkpoints/step-<N> in it, or one such directory"
        )
    path, manifest, skipped = found
    for line in skipped:
        note(line)
    return path, manifest


def restore(engine: EngineParts, path: Path, manifest: Manifest) -> None:
    """Fill the engine's tiers from a verified checkpoint and set its counters and RNG."""
    manifest.check_compatible(
        engine.layout.units,
        engine.layout.comm.world_size,
        dtype_name(engine.layout.dtype),
        str(path),
        engine.layout.stage,
    )
    tiers = engine.tiers
    wanted = [
        (unit, kind, key)
        for unit in engine.layout.units
        for kind in SAVED_KINDS
        for key, _, _ in engine.shards.keys(kind, unit)
    ]
    missing = [key for _, _, key in wanted if key not in manifest.arrays]
    if missing:
        written = manifest.engine.get("piece_numel")
        if written is not None and written != engine.config.streaming.piece_numel:
            raise CheckpointError(
                f"{path} was written with pieces of {written} elements and this engine "
                f"streams {engine.config.streaming.piece_numel}; build it with "
                f"piece_numel={written}"
            )
        raise CheckpointError(
            f"{path / MANIFEST_NAME} lists no array {missing[0]!r}: the checkpoint is "
            "incomplete, or was written with another piece size; use another one"
        )
    _check_formats(engine, manifest, path)
    copied = 0
    for unit in engine.layout.units:  # the engine owns the weights (as `Shards.materialise` does)
        detach_params(unit, engine.layout.dtype, engine.device)
    for _unit, kind, key in wanted:
        src, meta = manifest.array_dir(path, key), manifest.arrays[key]
        if engine.layout.placement.home(kind) is Tier.NVME:
            copied += tiers.run(tiers.stores[Tier.NVME].adopt(key, str(src), meta))
        else:
            engine.shards.put_key(kind, key, read_array(str(src), meta))
        if kind is StateKind.PARAM and tiers.host_pool is not None:
            tiers.host_pool.cache_drop(key)  # a cached param of the abandoned run is stale
        tiers.pending.drain()
    if engine.layout.placement.home(StateKind.GRAD) is not Tier.NVME:
        for unit in engine.layout.units:
            engine.shards.put_shard(
                StateKind.GRAD, unit, torch.zeros(unit.shard_numel, dtype=torch.float32)
            )
    if Tier.NVME in tiers.stores:
        tiers.run(tiers.stores[Tier.NVME].flush())
    if copied:
        engine.note(
            f"resuming copied {copied / 1e6:.1f} MB: the checkpoint is on another filesystem "
            "than --nvme-path"
        )
    if manifest.config_hash != numeric_config_hash(engine.config):
        engine.note(_settings_note(path, manifest, engine.config))
    _load_engine_state(engine, manifest.engine, path)
    rng = manifest.rng if manifest.rank_rng is None else manifest.rank_rng[engine.layout.comm.rank]
    _load_rng_state(rng, engine.device, path)


LEGACY_INT8_BLOCK = 2048  # what an int8 checkpoint that records no block was written with
# and one that records no codes: 8-bit Adam's dynamic map
LEGACY_INT8_CODES = "blockwise int8 dynamic quantisation"


def _check_formats(engine: EngineParts, manifest: Manifest, path: Path) -> None:
    """Refuse a checkpoint whose master or moments are stored in other formats than this
    engine steps (a checkpoint from before compact state has fp32 ones)."""
    ours = engine.shards.formats.describe()
    theirs = {field: manifest.engine.get(field, "fp32") for field in ours}
    if theirs != ours:
        field = next(f for f in ours if theirs[f] != ours[f])
        raise CheckpointError(
            f"{path} stores {field} as {theirs[field]} and this engine is configured for "
            f"{ours[field]}; build it with {field}={theirs[field]!r} (--{field.replace('_', '-')} "
            f"{theirs[field]})"
        )
    base = manifest.engine.get("quantize_base", "none")
    if base != engine.config.formats.quantize_base:  # the params' stored layout differs
        raise CheckpointError(
            f"{path} stores the frozen base with --quantize-base {base} and "
            f"this engine with {engine.config.formats.quantize_base}; resume with "
            f"--quantize-base {base}"
        )
    block = manifest.engine.get("int8_block", LEGACY_INT8_BLOCK)
    coded = manifest.engine.get("int8_codes", LEGACY_INT8_CODES)
    if engine.shards.formats.quantised(StateKind.EXP_AVG) and (block, coded) != (
        STATE_BLOCK,
        INT8_CODES,
    ):
        raise CheckpointError(
            f"{path} stores int8 moments as {coded} in blocks of {block} values and this "
            f"tierzero reads {INT8_CODES} in blocks of {STATE_BLOCK}; resume it with the "
            "tierzero that wrote it, or export its weights (tierzero export) and start a run "
            "from them"
        )


def _settings_note(path: Path, manifest: Manifest, config: Config) -> str:
    """What differs from the settings of the run that wrote the checkpoint (its config.toml), by
    name: a longer --steps only stretches the lr schedule, which is no other optimizer setting."""
    toml = manifest.origin.config_toml
    saved = tomllib.loads(toml) if toml else None
    if saved is None:
        return (
            f"{path.name} was written with other optimizer or precision settings; the resumed "
            "run will not match an uninterrupted one"
        )
    flat = config.flat()
    changed = [f for f in _NUMERIC_FIELDS if _plain(saved.get(f)) != _plain(flat[f])]
    if changed == ["total_steps"]:
        which = "longer" if config.optimizer.total_steps > saved["total_steps"] else "shorter"
        return (
            f"the lr schedule now spans {config.optimizer.total_steps} steps, not the "
            f"{saved['total_steps']} of the run that wrote {path.name} (--steps changed): from "
            f"here the lr follows the {which} schedule"
        )
    return (
        f"{path.name} was written with other settings ({', '.join(changed) or 'unrecorded'}); "
        "the resumed run will not match an uninterrupted one"
    )


def _plain(value: Any) -> Any:
    """A setting as `config_hash` sees it (enums as their values, tuples as lists), as TOML reads it
    back."""
    return json.loads(json.dumps(value, default=str))


def _engine_state(engine: EngineParts) -> dict[str, Any]:
    # the piece size the shards are keyed by: a load into an engine with another one is refused
    # naming it
    # and the stored formats of master and moments (`tierzero.compact.formats`), which a load checks
    return {
        **engine.counters.state.to_dict(),
        "scaler": engine.counters.scaler.state_dict(),
        "skipped_updates": engine.counters.param_steps.state_dict(),
        "piece_numel": engine.config.streaming.piece_numel,
        **engine.shards.formats.describe(),
        "int8_block": STATE_BLOCK,
        "int8_codes": INT8_CODES,
        "quantize_base": engine.config.formats.quantize_base,
        **({"nf4_weights": recorded_weights(coded)} if (coded := engine.shards.coded) else {}),
    }


def _load_engine_state(engine: EngineParts, state: dict[str, Any], path: Path) -> None:
    try:
        engine.counters.state.load(state)
        engine.counters.param_steps.load_state_dict(
            state.get("skipped_updates") or {}, str(path / MANIFEST_NAME)
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(
            f"{path / MANIFEST_NAME} has malformed engine state ({e!r}); use another checkpoint"
        ) from None
    if engine.counters.scaler.enabled:
        engine.counters.scaler.load_state_dict(state.get("scaler") or {})


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if device.type == "cuda":
        state["torch_cuda"] = base64.b64encode(
            torch.cuda.get_rng_state(device).numpy().tobytes()
        ).decode()
    return state


def _load_rng_state(state: dict[str, Any], device: torch.device, path: Path) -> None:
    try:
        torch.set_rng_state(_bytes_tensor(state["torch_cpu"]))
        if device.type == "cuda" and "torch_cuda" in state:
            torch.cuda.set_rng_state(_bytes_tensor(state["torch_cuda"]), device)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"{path / MANIFEST_NAME} has a malformed RNG state ({e}); use another checkpoint"
        ) from None


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def _replace_dir(temp: Path, final: Path) -> None:
    """Rename the finished directory into place, durably. A same-step one (a damaged checkpoint
    resume skipped, or the step of an fp16 overflow saved again) is swapped out in one atomic
    exchange where the filesystem can: renaming it aside first left an instant with no
    checkpoint of the step, and a kill there lost it (with keep 1, every checkpoint)."""
    trash = None
    if final.exists() and chunkfile.exchange(str(temp), str(final)):
        chunkfile.fsync_path(str(final.parent))
        shutil.rmtree(
            temp, ignore_errors=True
        )  # the old one, under the temp name (or the next save's)
        return
    if final.exists():
        trash = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.rename(final, trash)
    os.rename(temp, final)
    fsync_path(str(final.parent))
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _prepare_root(root: Path) -> None:
    """Create `checkpoints/` durably (its own name must survive a power loss with the first
    checkpoint in it) and remove a killed save's leftovers (the caller holds the run directory's
    lock). An OSError is one sentence naming the path."""
    try:
        if not root.is_dir():
            root.mkdir(parents=True, exist_ok=True)
            fsync_path(str(root.parent))
        for p in root.iterdir():
            if p.name.startswith(".step-") and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
    except OSError as e:
        raise os_error(e, "creating", str(root)) from e


def model_description(args: Any) -> dict[str, Any] | None:
    """A JSON-able description of a dataclass of model arguments, for humans reading manifests."""
    return dataclasses.asdict(args) if dataclasses.is_dataclass(args) else None
