"""Checkpoints through the Python API: a run stopped and resumed from its checkpoint ends
bitwise equal to one that never stopped, in every placement; a checkpoint copies no bytes of
NVMe-homed state; damaged or incompatible checkpoints are refused by name."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.support.engine import SMALL, batches, engine_config
from tierzero import Config, Placement, Tier, models
from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.checkpoint.manifest import Manifest
from tierzero.engine import Engine
from tierzero.errors import CheckpointError

PLACEMENTS = {
    "everything-on-nvme": Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME),
    "optimizer-on-host": Placement(Tier.GPU, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST),
    "mixed": Placement(Tier.NVME, Tier.HOST, Tier.NVME, Tier.HOST, Tier.NVME),
}


# this file's values: several pieces per unit
config = partial(engine_config, piece_numel=6144, warmup_steps=2, total_steps=6)


def engine_for(cfg: Config) -> Engine:
    return Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg)


def uninterrupted(cfg: Config, steps: int) -> dict[str, torch.Tensor]:
    data = batches()
    with engine_for(cfg) as engine:
        for _ in range(steps):
            engine.train_step(data.next_batch())
        return engine.master_state_dict()


@pytest.mark.parametrize(
    "name,clip",
    [("everything-on-nvme", None), ("optimizer-on-host", 0.5), ("mixed", None)],
    ids=["nvme", "host-clipped", "mixed"],
)
def test_resumed_run_is_bitwise_equal_to_an_uninterrupted_one(
    tmp_path: Path, name: str, clip
) -> None:
    kw = {"clip_grad_norm": clip, "clip_previous_norm": True} if clip else {}
    cfg = config(tmp_path, PLACEMENTS[name], **kw)
    (tmp_path / "ref").mkdir()
    reference = uninterrupted(config(tmp_path / "ref", PLACEMENTS[name], **kw), 6)
    run_dir = tmp_path / "run"
    data = batches()
    with engine_for(cfg) as engine:
        for _ in range(3):
            engine.train_step(data.next_batch())
        engine.save_checkpoint(run_dir, data=data.state_dict())
        for _ in range(2):  # steps the crash loses: the live store moves past the checkpoint
            engine.train_step(data.next_batch())
    data = batches()
    engine = engine_for(cfg)  # not opened: the checkpoint fills the tiers, nothing is materialised
    try:
        manifest = engine.load_checkpoint(run_dir)
        data.load_state_dict(manifest.data)
        assert engine.step_count == 3
        for _ in range(3):
            engine.train_step(data.next_batch())
        resumed = engine.master_state_dict()
    finally:
        engine.close()
    for key in reference:
        assert torch.equal(resumed[key], reference[key]), key


def test_a_checkpoint_of_nvme_state_copies_no_bytes(tmp_path: Path) -> None:
    cfg = config(tmp_path, PLACEMENTS["everything-on-nvme"])
    with engine_for(cfg) as engine:
        engine.train_step(batches().next_batch())
        path = engine.save_checkpoint(tmp_path)
        manifest = Manifest.load(path)
        assert manifest.origin.bytes_copied == 0 and manifest.nbytes > 0
        chunk = next((path / "state" / "master").rglob("c/0"))
        assert os.stat(chunk).st_nlink == 2  # the live store's file, linked
        before = chunk.read_bytes()
        for _ in range(3):  # rewrites must never touch the linked chunk
            engine.train_step(batches().next_batch())
        assert chunk.read_bytes() == before


def test_keep_prunes_old_checkpoints_and_never_the_live_store(tmp_path: Path) -> None:
    cfg = config(tmp_path, PLACEMENTS["everything-on-nvme"])
    data = batches()
    with engine_for(cfg) as engine:
        for _ in range(4):
            engine.train_step(data.next_batch())
            engine.save_checkpoint(tmp_path / "run", keep=2)
        assert [s for s, _ in checkpoint_dirs(tmp_path / "run")] == [3, 4]
        engine.train_step(data.next_batch())  # the live store still reads and writes
    with engine_for(cfg) as engine:
        engine.load_checkpoint(tmp_path / "run")
        assert engine.step_count == 4


def flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0x10
    path.write_bytes(raw)


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_a_damaged_checkpoint_is_named_and_the_previous_one_used(
    tmp_path: Path, damage: str
) -> None:
    cfg = config(tmp_path, PLACEMENTS["everything-on-nvme"])
    data = batches()
    with engine_for(cfg) as engine:
        for _ in range(2):
            engine.train_step(data.next_batch())
            engine.save_checkpoint(tmp_path / "run", data=data.state_dict())
    newest = checkpoint_dirs(tmp_path / "run")[-1][1]
    chunk = next((newest / "state" / "exp_avg").rglob("c/0"))
    if damage == "flip":
        flip_byte(chunk)
    elif damage == "truncate":
        os.truncate(chunk, 1000)
    else:
        (newest / "manifest.json").unlink()
    with engine_for(cfg) as engine:
        manifest = engine.load_checkpoint(tmp_path / "run")
        assert manifest.step == 1 and engine.step_count == 1
        why = {
            "flip": "fails its crc32c check",
            "truncate": "is truncated",
            "manifest": "manifest.json is missing",
        }
        assert any(newest.name in n and why[damage] in n for n in engine.notes()), engine.notes()


def test_an_incompatible_checkpoint_is_refused_in_one_sentence(tmp_path: Path) -> None:
    cfg = config(tmp_path, PLACEMENTS["everything-on-nvme"])
    with engine_for(cfg) as engine:
        engine.train_step(batches().next_batch())
        engine.save_checkpoint(tmp_path / "run")
    other = SMALL.__class__(**{**SMALL.__dict__, "ffn_dim": 128})
    with Engine(models.build(other, device="meta"), cfg) as engine:
        with pytest.raises(CheckpointError, match="is for another model shape"):
            engine.load_checkpoint(tmp_path / "run")


def test_a_checkpoint_mid_accumulation_is_refused(tmp_path: Path) -> None:
    cfg = config(tmp_path, PLACEMENTS["optimizer-on-host"], accumulate=2)
    with engine_for(cfg) as engine:
        engine.train_step(batches().next_batch())
        with pytest.raises(Exception, match="micro-batches are accumulated; save after step"):
            engine.save_checkpoint(tmp_path / "run")
