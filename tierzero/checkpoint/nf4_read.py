"""An NF4 base's param shards in a checkpoint, decoded to values (export, generate).

A run with `--quantize-base nf4` checkpoints each block's param shard as the engine stores it
(`tierzero.models.nf4_shard`: the trainable prefix as values, the frozen rest's pieces coded)
and its manifest names the coded weights (`nf4_weights`), so a reader rebuilds the stored
layout from the manifest alone and decodes the shard as a fetch does: bitwise the values the
run computed with, in its compute dtype. Every array is read through its recorded checksums.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tierzero.checkpoint.manifest import Manifest
from tierzero.config import StateKind
from tierzero.errors import CheckpointError
from tierzero.layout.keys import piece_key, shard_key
from tierzero.layout.partition import Unit
from tierzero.models.nf4_shard import CodedShard, recorded_mask
from tierzero.storage.base import DTYPES
from tierzero.storage.nvme.arrays import read_array


def coded_units(manifest: Manifest) -> dict[int, CodedShard]:
    """The checkpoint's coded units by index (none for a run without an NF4 base)."""
    engine = manifest.engine or {}
    names = engine.get("nf4_weights") or {}
    if not names:
        return {}
    dtype = DTYPES.get(manifest.compute_dtype)
    if dtype is None or not dtype.is_floating_point:
        raise CheckpointError(
            f"the checkpoint of step {manifest.step} records an NF4 base in "
            f"{manifest.compute_dtype!r}, no compute dtype: it is damaged"
        )
    found = {}
    for layout in manifest.units:
        if str(layout.index) not in names:
            continue
        unit = Unit(
            layout.index,
            layout.name,
            "block",
            None,
            numel=layout.numel,
            padded_numel=layout.padded_numel,
            trainable_numel=layout.trainable_numel,
        )
        slots = [(s.names[0], s.offset, s.numel) for s in layout.slots]
        mask = recorded_mask(layout.padded_numel, slots, names[str(layout.index)])
        found[layout.index] = CodedShard(unit, 0, engine["piece_numel"], dtype, mask)
    return found


def read_coded(checkpoint: Path, manifest: Manifest, coded: CodedShard, out: torch.Tensor) -> None:
    """Fill `out` (the unit's values, any float dtype) from its coded param shard."""
    stored = torch.empty(coded.stored_numel, dtype=coded.dtype)
    whole = shard_key(StateKind.PARAM, coded.unit.index, 0)
    if whole in manifest.arrays:  # a memory-homed param: one array, the pieces end to end
        parts = [(whole, 0, coded.stored_numel)]
    else:
        parts = [
            (piece_key(StateKind.PARAM, coded.unit.index, 0, i), p.at, p.end)
            for i, p in enumerate(coded.pieces)
        ]
    for key, at, end in parts:
        meta = manifest.arrays.get(key)
        if meta is None or meta.numel != end - at or meta.dtype != coded.dtype:
            raise CheckpointError(
                f"checkpoint {checkpoint.name} array {key} does not hold the NF4 "
                "base's stored piece its manifest names: it is damaged; export "
                "another step with --step"
            )
        stored[at:end] = read_array(str(manifest.array_dir(checkpoint, key)), meta)
    out.copy_(coded.decode(stored, torch.empty(coded.param_numel, dtype=coded.dtype)))
