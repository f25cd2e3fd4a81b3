"""Shared pieces of the engine tests: a small model, fixed batches, the one test config, the
reference run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tierzero import Config, Placement, Tier, models
from tierzero.models import ModelArgs
from tierzero.reference import ReferenceTrainer
from tierzero.run.data import TokenBatches, default_corpus

_TOKENS = default_corpus(1 << 20)

SMALL = ModelArgs(
    dim=64,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    ffn_dim=192,
    max_seq_len=64,
    tie_embeddings=True,
)


NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)


def engine_config(root: Path | str, placement: Placement | None = NVME, **overrides: Any) -> Config:
    """The engine config the tests train with: every state on NVMe under `root/nvme`, lr 3e-3 (a
    few steps move the weights visibly), 256 MiB host and device budgets (far above what `SMALL`
    needs, so no test is refused by accident); `overrides` are each test's own values. `root`
    is made if missing: tests pass subfolders of `tmp_path` to keep engines apart."""
    Path(root).mkdir(parents=True, exist_ok=True)
    settings = {
        "nvme_path": [str(Path(root) / "nvme")],
        "lr": 3e-3,
        "host_budget": "256MiB",
        "gpu_budget": "256MiB",
        **overrides,
    }
    return Config(placement=placement, **settings)


def batches(batch_size: int = 4, seq_len: int = 32, seed: int = 0) -> TokenBatches:
    return TokenBatches(_TOKENS, batch_size, seq_len, seed=seed)


def reference_run(
    args: ModelArgs, config: Config, steps: int, **batch_kw: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final fp32 weights of plain PyTorch training: the oracle."""
    trainer = ReferenceTrainer(models.build(args, seed=config.seed), config)
    data = batches(**batch_kw)
    losses = [
        trainer.train_step(data.next_batch()) for _ in range(steps * config.execution.accumulate)
    ]
    return losses, trainer.master_state_dict()


def engine_weights(args: ModelArgs, config: Config, steps: int) -> dict[str, torch.Tensor]:
    """Final fp32 master weights of the engine after `steps` train_steps on `batches()`: what
    `reference_run`'s are compared with."""
    from tierzero.engine import Engine

    data = batches()
    with Engine(models.build(args, device="meta", seed=config.seed), config) as engine:
        for _ in range(steps):
            engine.train_step(data.next_batch())
        return engine.master_state_dict()


def fresh(tmp_path, name: str):
    """A directory of its own under `tmp_path` (one engine's nvme store)."""
    (tmp_path / name).mkdir()
    return tmp_path / name


def assert_same(weights: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == ref.keys()
    for key in ref:
        assert torch.equal(weights[key], ref[key]), key
