"""Where the validation set comes from (`TokenBatches`): a split asked for (`val_fraction`,
refused when too small), the 5% split nobody asked for (dropped with a note on a small corpus),
or held-out data of its own (`held_out`, `--val-data`), plain or fine-tuning examples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierzero.errors import DataError
from tierzero.models.loss import IGNORE_INDEX
from tierzero.run.data import TokenBatches


def tokens(n: int, start: int = 0) -> np.ndarray:
    return (np.arange(start, start + n) % 250).astype(np.uint16)


def test_the_implicit_split_is_five_percent_where_the_corpus_spares_it() -> None:
    b = TokenBatches(tokens(10_000), 2, 32, seed=0)
    assert b.has_validation and b.note is None and len(b.val) == 500
    assert torch.equal(
        b.val_batches(32)[0][0][0], torch.from_numpy(tokens(10_000)[9500:9532].astype(np.int64))
    )


def test_a_small_corpus_trains_without_the_implicit_split_and_says_so() -> None:
    b = TokenBatches(tokens(1000), 2, 64, seed=0)
    assert not b.has_validation and len(b.train) == 1000
    assert (
        b.note is not None
        and "training without evaluation" in b.note
        and "leaves 50 for validation" in b.note
    )
    assert b.n_windows == 15  # every token trains


def test_an_asked_for_split_too_small_is_refused() -> None:
    with pytest.raises(
        DataError, match="leaves 20 for validation, too short for seq_len 64.*--val-fraction"
    ):
        TokenBatches(tokens(1000), 2, 64, seed=0, val_fraction=0.02)
    # none asked for: none, silently
    b = TokenBatches(tokens(1000), 2, 64, seed=0, val_fraction=0.0)
    assert not b.has_validation and b.note is None


def test_held_out_data_is_the_validation_set() -> None:
    b = TokenBatches(tokens(2000), 4, 16, seed=0, val_fraction=0.0)
    b.held_out(tokens(400, start=7))
    val = b.val_batches(10 * 16)
    # 10 windows, padded to 12 rows
    assert len(val) == 3 and all(x.shape == (4, 16) for x, _ in val)
    assert torch.equal(val[0][0][0], torch.from_numpy(tokens(16, start=7).astype(np.int64)))
    assert (val[-1][1][2:] == IGNORE_INDEX).all()  # the padding rows train nothing
    two = [
        TokenBatches(tokens(2000), 4, 16, seed=0, val_fraction=0.0, rank=r, world_size=2)
        for r in (0, 1)
    ]
    for part in two:
        part.held_out(tokens(400, start=7))
    assert torch.equal(torch.cat([p.val_batches(160)[0][0] for p in two]), val[0][0])  # ranks' rows


def test_held_out_examples_keep_their_trained_mask() -> None:
    ids = tokens(60)
    trained = np.zeros(60, dtype=np.uint8)
    trained[3:8] = trained[33:38] = 1  # the replies of the first and third of four examples
    b = TokenBatches(tokens(2000), 1, 16, seed=0, val_fraction=0.0)
    b.held_out(ids, trained, np.array([0, 15, 30, 45, 60]))
    val = b.val_batches(1000)
    assert len(val) == 2  # windows with nothing to train are never drawn
    targets = torch.cat([y for _, y in val]).flatten()
    assert int((targets != IGNORE_INDEX).sum()) == 10


def test_held_out_data_too_short_or_with_nothing_to_train_is_refused() -> None:
    b = TokenBatches(tokens(2000), 1, 16, seed=0, val_fraction=0.0)
    with pytest.raises(DataError, match="--val-data holds 10 tokens, too short for seq_len 16"):
        b.held_out(tokens(10))
    with pytest.raises(DataError, match="--val-data has no window of 17 tokens with a completion"):
        b.held_out(tokens(60), np.zeros(60, dtype=np.uint8), np.array([0, 15, 30, 45, 60]))
