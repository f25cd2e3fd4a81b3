"""Budget pressure with overlap_step: a step that waits for buffers must stay bitwise exact.

With the host budget just above the memory model's figure, leases in the optimizer's writes
wait on the pending queue, which returns finished writes' buffers to the pool meanwhile: the
new param piece must be taken from the master buffer before the master's write can give it back.
"""

from __future__ import annotations

import torch

from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine

from engine_helpers import batches, reference_run
from test_engine_out_of_core import DEEP


def test_overlap_under_budget_pressure_stays_bitwise(tmp_path) -> None:
    cfg = Config(placement=Placement(*[Tier.NVME] * 5), nvme_path=[str(tmp_path / "nvme")], lr=3e-3,
                 total_steps=5, host_budget=4 << 20, piece_numel=8192, prefetch_depth=2, overlap_step=True)
    _, ref_weights = reference_run(DEEP, cfg, steps=2)
    data = batches()
    with Engine(models.build(DEEP, device="meta", seed=cfg.seed), cfg) as engine:
        for _ in range(2):
            engine.train_step(data.next_batch())
        weights = engine.master_state_dict()
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key
