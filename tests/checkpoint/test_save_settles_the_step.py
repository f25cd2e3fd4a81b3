"""Reading shards right after an overlapped backward (overlap_step stepped every unit as its
grad arrived, but `step()` has not run): a checkpoint, `master_state_dict` or `read_shard` first
settles the step, so what they see is a finished step with its counters -- never stepped
weights under the old step count, which a resume would step a second time."""

from __future__ import annotations

import torch

from tests.support.engine import SMALL, batches, reference_run
from tierzero import Config, Placement, Tier, models
from tierzero.config import StateKind
from tierzero.engine import Engine


def test_a_save_between_an_overlapped_backward_and_step_holds_the_finished_step(tmp_path) -> None:
    cfg = Config(
        placement=Placement(*[Tier.NVME] * 5),
        nvme_path=[str(tmp_path / "nvme")],
        lr=3e-3,
        warmup_steps=1,
        total_steps=3,
        host_budget="256MiB",
    )
    _, ref_weights = reference_run(SMALL, cfg, steps=1)
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        assert engine.parts.overlap
        engine.backward(engine.forward(batches().next_batch()))
        assert engine.read_shard(StateKind.MASTER, engine.units[1]).numel() > 0
        saved = engine.save_checkpoint(tmp_path / "run")
        assert engine.parts.counters.state.step_count == 1 and saved.name == "step-00000001"
        assert not engine.step()  # settled already: the same grads are never stepped twice
    cfg2 = cfg.replace(nvme_path=[str(tmp_path / "nvme2")])
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg2) as resumed:
        resumed.load_checkpoint(saved)
        assert resumed.parts.counters.state.step_count == 1
        weights = resumed.master_state_dict()
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key
