"""Out of core: training state several times the host budget, every tier under budget.

The pools assert their budgets themselves (a lease over budget raises); here we also read
their high-water marks and compare the result with plain PyTorch, bitwise.
"""

from __future__ import annotations

import torch

from tests.support.engine import batches, reference_run
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.models import ModelArgs

DEEP = ModelArgs(
    dim=64,
    n_layers=16,
    n_heads=4,
    n_kv_heads=4,
    vocab_size=256,
    ffn_dim=192,
    max_seq_len=64,
    tie_embeddings=True,
)
# 8 MiB of RAM in all: the CPU device pool, the activations and a pass with overlap_step
HOST_BUDGET = 8 << 20
GPU_BUDGET = 1 << 20


def test_state_twice_the_host_budget_trains_exactly(tmp_path) -> None:
    cfg = Config(
        placement=Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME),
        nvme_path=[str(tmp_path / "a"), str(tmp_path / "b")],
        lr=3e-3,
        total_steps=3,
        host_budget=HOST_BUDGET,
        gpu_budget=GPU_BUDGET,
        prefetch_depth=2,
    )
    _, ref_weights = reference_run(DEEP, cfg, steps=3)
    data = batches()
    with Engine(models.build(DEEP, device="meta", seed=cfg.seed), cfg) as engine:
        state_bytes = sum(u.shard_numel for u in engine.units) * (4 + 4 + 4 + 4 + 4)
        assert state_bytes >= 2 * HOST_BUDGET
        for _ in range(3):
            engine.train_step(data.next_batch())
        peaks = engine.parts.tiers.peaks()
        weights = engine.master_state_dict()
    assert 0 < peaks["host"] <= HOST_BUDGET
    assert 0 < peaks["gpu"] <= GPU_BUDGET
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key
    # both drives hold shards: striping spreads the units
    assert any((tmp_path / "a").rglob("*")) and any((tmp_path / "b").rglob("*"))
