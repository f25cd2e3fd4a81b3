"""The reference trainer (the oracle) learns on the default corpus, and its pieces behave."""

from __future__ import annotations

import pytest
import torch

from tierzero import Config, models
from tierzero.lr import lr_at
from tierzero.reference import ReferenceTrainer
from tierzero.run.data import TokenBatches, default_corpus

VAL_LOSS_BOUND = 3.2  # nats/byte; the untrained model sits near ln(256) = 5.55


def test_validation_loss_drops_below_bound_on_default_corpus() -> None:
    cfg = Config(offload="none", lr=2e-3, total_steps=40, warmup_steps=4)
    trainer = ReferenceTrainer(models.build("tiny", seed=0), cfg)
    data = TokenBatches(default_corpus(2 << 20), batch_size=8, seq_len=64, seed=0)
    val = data.val_batches(4)
    before = sum(trainer.eval_loss(b) for b in val) / len(val)
    for _ in range(40):
        trainer.train_step(data.next_batch())
    after = sum(trainer.eval_loss(b) for b in val) / len(val)
    assert before > 5.0
    assert after < VAL_LOSS_BOUND, after


def test_lr_schedule_warmup_then_cosine_to_floor() -> None:
    cfg = Config(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg.optimizer) for s in range(16)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and lrs[9] == pytest.approx(0.55) and lrs[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lr_at(7, Config(lr=0.5, lr_schedule="constant").optimizer) == 0.5


def test_accumulation_steps_once_per_global_batch() -> None:
    cfg = Config(offload="none", accumulate=3, lr=1e-2)
    trainer = ReferenceTrainer(models.build("tiny", seed=0), cfg)
    before = trainer.master_state_dict()["norm.weight"].clone()
    x = torch.randint(0, 256, (2, 16))
    trainer.train_step((x, x))
    trainer.train_step((x, x))
    assert trainer.step_count == 0 and torch.equal(
        trainer.master_state_dict()["norm.weight"], before
    )
    trainer.train_step((x, x))
    assert trainer.step_count == 1 and not torch.equal(
        trainer.master_state_dict()["norm.weight"], before
    )
