"""A step does not wait for the NVMe flush: durability belongs to checkpoints
(they flush before linking) and `close`; the per-step flush only turns the blocks the step
superseded into spares, behind the next step. Compared: a syncfs held until the test releases
it after `train_step` returned (a step that waited for it would return only when the hold gave
up), and the weights of that run against plain PyTorch, bitwise."""

from __future__ import annotations

import threading

import torch
from tierzero.storage.nvme import chunkfile

from tests.support.engine import SMALL, batches, reference_run
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine


def test_a_step_returns_before_its_flush_and_training_stays_exact(tmp_path, monkeypatch) -> None:
    cfg = Config(
        placement=Placement(*[Tier.NVME] * 5),
        nvme_path=[str(tmp_path / "nvme")],
        lr=3e-3,
        warmup_steps=1,
        total_steps=3,
        host_budget="256MiB",
        piece_numel=6144,
    )
    _, ref_weights = reference_run(SMALL, cfg, steps=3)
    gate, released = threading.Event(), []
    sync = chunkfile.sync_filesystem

    def held(path: str) -> None:
        released.append(gate.wait(timeout=30))  # True: the test let it go after the step returned
        sync(path)

    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        engine.train_step(data.next_batch())
        engine.parts.tiers.wait_flush()  # the first step's flush must not meet the hold below
        monkeypatch.setattr(chunkfile, "sync_filesystem", held)
        engine.train_step(data.next_batch())
        gate.set()
        engine.train_step(data.next_batch())  # waits for the previous flush before its own
        weights = engine.master_state_dict()
    assert released and all(released)
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key
