"""Tampered compact state: a flipped byte in an int8 moment's codes or in its absmax scales, in a
bf16 moment, or in a bf16 master (the param itself with bf16 compute, its own array with fp32
compute) fails the resume's crc32c check, is named (checkpoint and chunk file), and the
checkpoint before it is resumed instead -- the next step ends bitwise where the undamaged run
did, so no damaged value was ever trained on; with no older checkpoint the resume is refused.
Grads are not checkpointed: with one micro-batch a bf16 grad is stepped from memory, and a
flipped byte in the store's grad chunk changes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import flip_byte
from tests.support.engine import SMALL, assert_same, batches, engine_config
from tierzero import Config, models
from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.checkpoint.manifest import Manifest
from tierzero.config import StateKind
from tierzero.engine import Engine
from tierzero.errors import CheckpointError

PIECE = 16384  # a block unit's first piece: 64 fp32 absmax scales (256 bytes), then 16384 codes
KINDS = (StateKind.PARAM, StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)


def _config(root: Path, dtype: str, moments: str, master: str) -> Config:
    return engine_config(
        root,
        dtype=dtype,
        optimizer_state=moments,
        master=master,
        piece_numel=PIECE,
        total_steps=6,
    )


def _engine(config: Config) -> Engine:
    return Engine(models.build(SMALL, device="meta", seed=0), config)


def _state(engine: Engine) -> dict[str, torch.Tensor]:
    """Every stored shard of the engine (params, masters, moments), by kind and unit."""
    return {
        f"{kind.value}/{unit.index}": engine.read_shard(kind, unit)
        for unit in engine.units
        for kind in KINDS
        if engine.keys(kind, unit)
    }


def _region(checkpoint: Path, key: str, region: str | None) -> int:
    """An offset inside `region` ("scales" or "codes") of the array's packed layout, else byte
    100."""
    meta = json.loads((checkpoint / "state" / key / "zarr.json").read_text())["attributes"][
        "tierzero"
    ]
    if region is None:
        assert "layout" not in meta, meta  # a plain bf16 array
        return 100
    part = meta["layout"][region]
    size = 4 if part["data_type"] == "float32" else 1
    offset = part["offset"] + size * (part["count"] // 2) + size - 1  # a scale's sign and exponent
    assert part["offset"] <= offset < part["offset"] + size * part["count"]
    return offset


CASES = {  # (compute dtype, moments, master, the array flipped, the region of its packed layout)
    "int8-codes": ("bf16", "int8", "bf16", "exp_avg/u0001/r0/p0000", "codes"),
    "int8-scales": ("bf16", "int8", "bf16", "exp_avg_sq/u0001/r0/p0000", "scales"),
    "bf16-master-is-the-param": ("bf16", "int8", "bf16", "param/u0001/r0/p0000", None),
    "bf16-master": ("fp32", "int8", "bf16", "master/u0001/r0/p0000", None),
    "bf16-moment": ("bf16", "bf16", "fp32", "exp_avg/u0002/r0/p0001", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_flipped_byte_is_named_and_the_checkpoint_before_it_resumed_bitwise(
    tmp_path: Path, case: str
) -> None:
    dtype, moments, master, key, region = CASES[case]
    data = batches()
    steps = [data.next_batch() for _ in range(2)]
    with _engine(_config(tmp_path / "a", dtype, moments, master)) as engine:
        for batch in steps:
            engine.train_step(batch)
            engine.save_checkpoint(tmp_path / "run")
        straight, weights = _state(engine), engine.master_state_dict()
    newest = checkpoint_dirs(tmp_path / "run")[-1][1]
    assert key in Manifest.load(newest).arrays
    flipped = flip_byte(newest, key, offset=_region(newest, key, region))
    with _engine(_config(tmp_path / "b", dtype, moments, master)) as engine:
        assert engine.load_checkpoint(tmp_path / "run").step == 1 and engine.step_count == 1
        assert any(newest.name in n and "crc32c" in n and flipped in n for n in engine.notes()), (
            engine.notes()
        )
        engine.train_step(steps[1])
        resumed = _state(engine)
        assert_same(engine.master_state_dict(), weights)
    assert resumed.keys() == straight.keys()
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name
    # no older checkpoint left to fall back to: refused, naming the damage
    shutil.rmtree(checkpoint_dirs(tmp_path / "run")[0][1])
    with (
        pytest.raises(
            CheckpointError,
            match=f"no intact checkpoint is left .*{newest.name} is damaged",
        ),
        _engine(_config(tmp_path / "c", dtype, moments, master)) as engine,
    ):
        engine.load_checkpoint(tmp_path / "run")


def test_bf16_grads_are_not_checkpointed_and_a_flipped_grad_chunk_is_never_read(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path, "bf16", "int8", "bf16")
    data = batches()
    steps = [data.next_batch() for _ in range(2)]
    with _engine(cfg) as engine:
        engine.train_step(steps[0])
        engine.save_checkpoint(tmp_path / "run")
        engine.train_step(steps[1])
        straight = _state(engine)
    manifest = Manifest.load(checkpoint_dirs(tmp_path / "run")[-1][1])
    assert {key.split("/")[0] for key in manifest.arrays} == {
        "param",
        "exp_avg",
        "exp_avg_sq",
    }
    grads = sorted((tmp_path / "nvme" / "grad").rglob("c/0"))
    assert grads  # the grad home exists on the drive; with one micro-batch nothing reads it back
    for chunk in grads:
        meta = json.loads((chunk.parents[1] / "zarr.json").read_text())["attributes"]["tierzero"]
        assert meta["dtype"] == "bfloat16"
    for chunk in grads:
        raw = bytearray(Path(chunk).read_bytes())
        raw[0] ^= 0xFF
        Path(chunk).write_bytes(raw)
    with _engine(cfg) as engine:  # the same store, its grad chunks flipped
        engine.load_checkpoint(tmp_path / "run")
        engine.train_step(steps[1])
        resumed = _state(engine)
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name
