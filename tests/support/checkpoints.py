"""Checkpoints built by hand from a model's weights, for tests of what reads checkpoints.

`write_checkpoint` lays a model out the way the engine does (`partition` -> padded fp32 flat
buffer per unit -> one shard per rank) and writes the frozen arrays and the manifest of
`RUN_DIR/checkpoints/step-<N>/`, so export and inspect can be tested without training.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from tierzero.storage.nvme.arrays import chunk_path, write_array
from torch import nn

from tierzero.checkpoint.catalog import step_dir
from tierzero.checkpoint.manifest import MANIFEST_NAME, Manifest, Origin, layout_of
from tierzero.config import StateKind
from tierzero.layout.keys import shard_key
from tierzero.layout.partition import Unit, partition

KINDS = (StateKind.PARAM, StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)


def flat_master(unit: Unit) -> torch.Tensor:
    """The unit's parameters, end to end in slot order, zero-padded to `padded_numel`."""
    flat = torch.zeros(unit.padded_numel, dtype=torch.float32)
    for slot in unit.slots:
        module, attr = slot.module_attrs[0]
        flat[slot.offset : slot.end] = getattr(module, attr).detach().float().reshape(-1)
    return flat


def write_checkpoint(
    run_dir: str | Path,
    model: nn.Module,
    step: int,
    world_size: int = 1,
    chunk_bytes: int = 64 << 10,
    kinds: tuple[StateKind, ...] = KINDS,
) -> Path:
    """Write `model`'s weights as the checkpoint of `step` (master = the weights; param a bf16
    copy; Adam moments zeros and squares, so every kind is present); returns its directory."""
    units = partition(model, world_size)
    path = step_dir(run_dir, step)
    manifest = Manifest(
        step=step,
        world_size=world_size,
        compute_dtype="bf16",
        config_hash="0" * 16,
        units=layout_of(units),
        arrays={},
        origin=Origin(time.time()),
        engine={"step_count": step},
    )
    for unit in units:
        master = flat_master(unit)
        values = {
            StateKind.PARAM: master.to(torch.bfloat16),
            StateKind.MASTER: master,
            StateKind.EXP_AVG: torch.zeros_like(master),
            StateKind.EXP_AVG_SQ: master * master,
        }
        for kind in kinds:
            for rank in range(world_size):
                lo, hi = unit.shard_range(rank)
                key = shard_key(kind, unit.index, rank)
                manifest.arrays[key] = write_array(
                    str(manifest.array_dir(path, key)), values[kind][lo:hi].clone(), chunk_bytes
                )
    (path / MANIFEST_NAME).write_bytes(manifest.to_json())
    return path


def flip_byte(checkpoint: Path, key: str, chunk: int = 0, offset: int = 100) -> str:
    """Flip one byte of a chunk file of the array `key` (in place); returns the file's path."""
    path = chunk_path(str(checkpoint / "state" / key), chunk)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


def files_under(root: Path) -> set[str]:
    return {
        os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names
    }
