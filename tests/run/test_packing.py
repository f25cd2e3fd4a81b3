"""Fine-tuning examples in windows: packed whole, long ones truncated, split or dropped; one-row
batches keep their inputs; the validation set is the same tokens for any batch size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierzero import Config, models
from tierzero.config import LongExamples
from tierzero.models import ModelArgs
from tierzero.reference import ReferenceTrainer
from tierzero.run.data import TokenBatches
from tierzero.run.loop import evaluate
from tierzero.run.packing import Examples, fit_examples, pack


def examples(lengths: list[int], prompts: list[int]) -> Examples:
    """Examples of `lengths` tokens (ids count up from 1) whose first `prompts` tokens are
    context."""
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    trained = np.concatenate(
        [(np.arange(n) >= p).astype(np.uint8) for n, p in zip(lengths, prompts)]
    )
    return Examples(np.arange(1, bounds[-1] + 1, dtype=np.uint16), trained, bounds)


def test_windows_hold_whole_examples() -> None:
    firsts, lasts = pack(np.array([0, 5, 9, 20, 24, 30]), window=11)
    assert firsts.tolist() == [0, 9, 20] and lasts.tolist() == [9, 20, 30]


def test_truncate_keeps_the_prompts_end_and_the_replys_start() -> None:
    data = examples([5, 30, 30, 30], [2, 25, 3, 15])
    fitted, counts = fit_examples(data, window=10, policy=LongExamples.TRUNCATE)
    assert (counts.examples, counts.long) == (4, 3)
    assert np.diff(fitted.bounds).tolist() == [5, 10, 10, 10]
    pieces = [fitted.ids[a:b].tolist() for a, b in zip(fitted.bounds[:-1], fitted.bounds[1:])]
    assert pieces[1] == list(range(6 + 20, 6 + 30))  # a short reply whole, beside 5 prompt tokens
    assert pieces[2] == list(range(36, 46))  # a short prompt whole, then the reply's start
    assert pieces[3] == list(range(66 + 10, 66 + 20))  # half a window of each
    assert [
        fitted.trained[a:b].tolist().index(1) for a, b in zip(fitted.bounds[:-1], fitted.bounds[1:])
    ] == [2, 5, 3, 5]


def test_split_shares_one_token_between_windows_and_drop_leaves_out() -> None:
    data = examples([4, 25], [1, 3])
    split, counts = fit_examples(data, window=10, policy=LongExamples.SPLIT)
    assert counts.long == 1 and np.diff(split.bounds).tolist() == [4, 10, 10, 7]
    assert split.ids[4:].tolist() == [*range(5, 15), *range(14, 24), *range(23, 30)]
    dropped, _ = fit_examples(data, window=10, policy=LongExamples.DROP)
    assert dropped.ids.tolist() == [1, 2, 3, 4] and dropped.bounds.tolist() == [0, 4]


def test_targets_past_a_windows_last_example_are_masked() -> None:
    data = examples([6, 6, 6] * 20, [3, 3, 3] * 20)
    batches = TokenBatches(
        data.ids,
        4,
        seq_len=15,
        seed=0,
        trained=data.trained,
        examples=data.bounds,
        val_fraction=0.0,
    )
    x, y = batches.next_batch()
    assert ((x[:, 0] - 1) % 6 == 0).all()  # every window starts with an example
    kept = y != -100
    assert kept.sum(dim=1).tolist() == [6] * 4  # two examples of 3 trained targets each per window
    assert not kept[:, 11:].any()  # the third example would not fit: never a target


@pytest.mark.parametrize("world_size", [1, 2])
def test_one_row_per_rank_keeps_its_inputs(world_size: int) -> None:
    """x and y of a one-row batch are separate tensors: masking y leaves x the tokens."""
    data = examples([8] * 40, [5] * 40)
    for rank in range(world_size):
        batches = TokenBatches(
            data.ids,
            world_size,
            seq_len=15,
            seed=0,
            trained=data.trained,
            examples=data.bounds,
            rank=rank,
            world_size=world_size,
        )
        for _ in range(5):
            x, y = batches.next_batch()
            assert x.shape == (1, 15) and (x > 0).all()  # ids count from 1: no -100 in the inputs
            assert torch.equal(x[0, 1:][y[0, :-1] != -100], y[0, :-1][y[0, :-1] != -100])


def test_the_validation_set_is_the_same_tokens_for_any_batch_size() -> None:
    tokens = np.arange(20_000) % 251
    trained = (np.random.default_rng(0).random(len(tokens)) < 0.3).astype(np.uint8)
    trainer = ReferenceTrainer(
        models.build(
            ModelArgs(
                dim=32,
                n_layers=1,
                n_heads=2,
                n_kv_heads=2,
                vocab_size=256,
                ffn_dim=64,
                max_seq_len=32,
            ),
            seed=0,
        ),
        Config(offload="none"),
    )
    losses, rows = [], []
    for batch_size in (1, 3, 8):
        batches = TokenBatches(tokens, batch_size, 32, seed=0, trained=trained)
        val = batches.val_batches(eval_tokens=20 * 32)
        rows.append(torch.cat([x for x, _ in val])[:20])
        # padded rows train nothing
        assert sum(int((y != -100).any(dim=1).sum()) for _, y in val) == 20
        losses.append(evaluate(trainer, batches, 20 * 32))
    assert all(torch.equal(r, rows[0]) for r in rows)
    assert max(losses) - min(losses) < 1e-6, losses
