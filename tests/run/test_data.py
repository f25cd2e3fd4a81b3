"""Token data: file formats, the default corpus, and the batch order's determinism and resume."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tierzero.errors import ConfigError, DataError
from tierzero.run.data import TokenBatches, default_corpus, load_tokens

TOKENS = np.arange(10_000, dtype=np.uint16)  # token id == its position in the corpus


def batches(seed: int = 0, **kw) -> TokenBatches:
    return TokenBatches(TOKENS, **(dict(batch_size=4, seq_len=16, seed=seed) | kw))


def draw(b: TokenBatches, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [b.next_batch() for _ in range(n)]


def same(a: list, b: list) -> bool:
    return all(
        torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True)
    )


def test_batch_shapes_and_shift() -> None:
    x, y = batches().next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, x + 1)


def test_same_seed_same_batches_different_seed_different() -> None:
    assert same(draw(batches(seed=1), 5), draw(batches(seed=1), 5))
    assert not same(draw(batches(seed=1), 5), draw(batches(seed=2), 5))


def test_an_epoch_visits_every_training_window_once() -> None:
    b = batches(batch_size=1)
    starts = sorted(b.next_batch()[0][0, 0].item() for _ in range(b.n_windows))
    assert starts == sorted(int(TOKENS[i * 16]) for i in range(b.n_windows))
    assert b.state_dict()["epoch"] == 1


@pytest.mark.parametrize("k", [3, 10])  # resume inside the first epoch, and inside the second
def test_resume_continues_exactly_like_an_uninterrupted_run(k: int) -> None:
    # seq_len 256 leaves 37 training windows: 20 batches of 4 cross two epoch boundaries
    uninterrupted = draw(batches(seq_len=256), 20)
    first = batches(seq_len=256)
    draw(first, k)
    resumed = batches(seq_len=256)
    resumed.load_state_dict(first.state_dict())
    assert same(draw(resumed, 20 - k), uninterrupted[k:])


def test_each_epoch_has_its_own_order() -> None:
    b = batches(batch_size=1)
    epoch0, epoch1 = (
        torch.cat([b.next_batch()[0][:, 0] for _ in range(b.n_windows)]) for _ in range(2)
    )
    assert not torch.equal(epoch0, epoch1)
    assert torch.equal(epoch0.sort().values, epoch1.sort().values)


def test_state_dict_is_json_plain() -> None:
    state = batches().state_dict()
    assert json.loads(json.dumps(state)) == state


def test_resume_with_another_seq_len_is_refused() -> None:
    with pytest.raises(DataError, match="same data, --seq-len and --seed"):
        batches(seq_len=8).load_state_dict(batches(seq_len=16).state_dict())


def test_val_split_is_disjoint_from_training_and_deterministic() -> None:
    b = batches(val_fraction=0.1)  # positions 9000.. are validation
    b.load_state_dict(b.state_dict())
    train = draw(b, 2 * b.n_windows // 4)  # two epochs
    assert max(int(y.max()) for _, y in train) < 9000
    val = b.val_batches(3)
    assert same(val, b.val_batches(3))
    assert min(int(x.min()) for x, _ in val) == 9000
    assert torch.equal(val[0][0][0], torch.arange(9000, 9016))  # windows in order


def test_vocab_size_needed() -> None:
    assert batches().vocab_size_needed == 10_000
    assert TokenBatches(np.zeros(1000, np.uint8), 1, 8, 0).vocab_size_needed == 256


@pytest.mark.parametrize(
    "kw", [dict(batch_size=0), dict(seq_len=0), dict(val_fraction=1.0), dict(seed=-1)]
)
def test_bad_settings_are_config_errors(kw: dict) -> None:
    with pytest.raises(ConfigError):
        batches(**kw)


def test_corpus_shorter_than_seq_len() -> None:
    with pytest.raises(DataError, match="too short for seq_len 64.*smaller --seq-len"):
        TokenBatches(np.zeros(50, np.uint8), batch_size=1, seq_len=64, seed=0)


def test_validation_split_shorter_than_seq_len() -> None:
    with pytest.raises(DataError, match="for validation, too short for seq_len 100"):
        TokenBatches(np.zeros(1000, np.uint8), batch_size=1, seq_len=100, seed=0, val_fraction=0.05)


def test_text_file_is_byte_tokens(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("héllo")
    tokens = load_tokens(path)
    assert tokens.dtype == np.uint8 and bytes(tokens) == "héllo".encode()


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_bin_file(tmp_path: Path, dtype: type) -> None:
    ids = np.array([0, 1, 70_000 % np.iinfo(dtype).max, 5], dtype=dtype)
    ids.tofile(tmp_path / "ids.bin")
    tokens = load_tokens(tmp_path / "ids.bin", dtype=dtype)
    assert isinstance(tokens, np.memmap) and tokens.dtype == dtype
    assert np.array_equal(tokens, ids)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_npy_file(tmp_path: Path, dtype: type) -> None:
    ids = np.arange(100, dtype=dtype) * 3
    np.save(tmp_path / "ids.npy", ids)
    tokens = load_tokens(tmp_path / "ids.npy")
    assert tokens.dtype == dtype and np.array_equal(tokens, ids)


def test_npy_with_wrong_dtype(tmp_path: Path) -> None:
    np.save(tmp_path / "ids.npy", np.arange(10, dtype=np.float32))
    with pytest.raises(
        DataError, match=r"ids.npy' holds a 1-D float32 array; save token ids as a 1-D uint16"
    ):
        load_tokens(tmp_path / "ids.npy")


def test_npy_that_is_not_npy(tmp_path: Path) -> None:
    (tmp_path / "ids.npy").write_bytes(b"not an array")
    with pytest.raises(DataError, match="is not a readable .npy array"):
        load_tokens(tmp_path / "ids.npy")


def test_bin_with_partial_token(tmp_path: Path) -> None:
    (tmp_path / "ids.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError, match="not a whole number of uint16 token ids"):
        load_tokens(tmp_path / "ids.bin")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(
        DataError, match=r"'.*nope.txt' does not exist; pass an existing .txt, .bin or .npy"
    ):
        load_tokens(tmp_path / "nope.txt")


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty.bin").touch()
    with pytest.raises(DataError, match="'.*empty.bin' is empty"):
        load_tokens(tmp_path / "empty.bin")


def test_default_corpus_is_deterministic_stdlib_text() -> None:
    corpus = default_corpus(max_bytes=1 << 20)
    assert corpus.dtype == np.uint8 and len(corpus) == 1 << 20
    assert np.array_equal(corpus, default_corpus(max_bytes=1 << 20))
    assert b"def " in bytes(corpus[:100_000]) and b"import " in bytes(corpus[:100_000])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_read_disjoint_rows_of_the_same_global_batch(world_size: int) -> None:
    whole = draw(batches(batch_size=8), 30)  # 30 batches: past an epoch's end
    ranks = [
        draw(batches(batch_size=8, rank=r, world_size=world_size), 30) for r in range(world_size)
    ]
    for step, (x, y) in enumerate(whole):
        assert torch.equal(torch.cat([r[step][0] for r in ranks]), x)
        assert torch.equal(torch.cat([r[step][1] for r in ranks]), y)
    val = batches(batch_size=8).val_batches(2)
    for i, (x, _) in enumerate(val):
        parts = [
            batches(batch_size=8, rank=r, world_size=world_size).val_batches(2)[i][0]
            for r in range(world_size)
        ]
        assert torch.equal(torch.cat(parts), x)
    one = batches(batch_size=8, rank=1, world_size=world_size)
    draw(one, 3)
    # one position, whatever the rank
    assert one.state_dict() == draw_state(batches(batch_size=8), 3)


def draw_state(b: TokenBatches, n: int) -> dict:
    draw(b, n)
    return b.state_dict()


def test_a_global_batch_that_does_not_split_over_the_ranks() -> None:
    with pytest.raises(ConfigError, match="batch_size 6 .* does not split evenly over 4 ranks"):
        batches(batch_size=6, rank=0, world_size=4)
