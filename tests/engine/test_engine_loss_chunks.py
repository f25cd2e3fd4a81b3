"""The engine with the loss computed in several checkpointed chunks, against plain PyTorch.

Backward recomputes each chunk's logits through the head module after the head unit's own
recompute has returned, so the head's weights must stay bound until its backward is done.
Compared: fp32, one rank, the same chunking in both -> bitwise equal losses and weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.engine import SMALL, batches
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.models.loss import chunk_tokens_for
from tierzero.reference import ReferenceTrainer

CHUNK_BYTES = 4 * SMALL.vocab_size * 40  # 40 tokens per chunk: a 4 x 32 batch takes 4 chunks


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_loss_trains_bitwise_equal_to_reference(tmp_path, tied: bool) -> None:
    args = SMALL if tied else type(SMALL)(**{**vars(SMALL), "tie_embeddings": False})
    assert chunk_tokens_for(args.vocab_size, CHUNK_BYTES) < 4 * 32
    cfg = Config(
        placement=Placement(*[Tier.NVME] * 5),
        nvme_path=[str(tmp_path / "nvme")],
        lr=3e-3,
        total_steps=3,
        host_budget="256MiB",
        gpu_budget="256MiB",
    )
    reference = models.build(args, seed=cfg.seed)
    reference.loss_chunk_bytes = CHUNK_BYTES
    trainer = ReferenceTrainer(reference, cfg)
    data = batches()
    ref_losses = [trainer.train_step(data.next_batch()) for _ in range(3)]
    model = models.build(args, device="meta", seed=cfg.seed)
    model.loss_chunk_bytes = CHUNK_BYTES
    data = batches()
    with Engine(model, cfg) as engine:
        losses = [engine.train_step(data.next_batch()) for _ in range(3)]
        weights = engine.master_state_dict()
    assert losses == ref_losses
    for key, value in trainer.master_state_dict().items():
        assert torch.equal(weights[key], value), key
