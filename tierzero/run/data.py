"""Token data: loading token arrays and drawing deterministic, resumable batches from them.

Owns the default corpus (the Python standard library's own sources: real text, on every
machine, nothing downloaded or bundled), the token-file formats, and the batch order. It never
touches a model or a device: batches are CPU int64 tensors.

Batch order: the training split is cut into non-overlapping windows of seq_len + 1 tokens
(consecutive windows share one token, so every token is a target once per epoch). Each epoch
visits every window once, in a permutation drawn from (seed, epoch). The position in that
order is the whole state, so a resumed run sees exactly the batches an uninterrupted one would.

Fine-tuning examples come with a `trained` mask, one entry per token (`tierzero.run.corpus`):
a target that is not trained is -100 in y, which the loss ignores (its mean is over trained
targets), and a window without a trained target is never drawn.

Ranks: `batch_size` is the global batch. Every rank walks the same order and takes its own
contiguous rows of each batch (rank r of N: rows r*B/N .. (r+1)*B/N), so the global batch is
the same for any world size, the slices are disjoint, and the position is one number for all
ranks (saved once, by rank 0).
"""

import os
import sysconfig
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from numpy.typing import DTypeLike

from tierzero.errors import ConfigError, DataError
from tierzero.models.loss import IGNORE_INDEX

TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.uint32))
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def default_corpus(max_bytes: int = 8 << 20) -> np.ndarray:
    """Byte tokens (uint8) of the standard library's .py files, in sorted order, up to max_bytes.

    The same Python installation always gives the same bytes; other Python versions give other
    (similar) text. Test suites are skipped: they are repetitive and some hold binary blobs.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    text = bytearray()
    for path in _stdlib_sources(root):
        text += path.read_bytes()
        if len(text) >= max_bytes:
            break
    if not text:
        raise DataError(f"found no .py files under the standard library at '{root}'; pass a text file with --data")
    return np.frombuffer(bytes(text[:max_bytes]), dtype=np.uint8)


def _stdlib_sources(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)  # sorted in place: walk order
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def load_tokens(path: str | os.PathLike, dtype: DTypeLike = np.uint16) -> np.ndarray:
    """Memory-mapped tokens of a file: `.npy` (uint16/uint32 array), `.bin` (raw ids of `dtype`),
    anything else as text (one uint8 token per byte)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file '{path}' does not exist; pass an existing .txt, .bin or .npy file, "
                        "or leave --data out to use the default corpus")
    if path.stat().st_size == 0:
        raise DataError(f"data file '{path}' is empty; pass a file with tokens in it")
    try:
        if path.suffix == ".npy":
            tokens = _load_npy(path)
        elif path.suffix == ".bin":
            tokens = _load_bin(path, np.dtype(dtype))
        else:
            tokens = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise DataError(f"cannot read data file '{path}' ({e.strerror or e}); check its permissions") from None
    if tokens.size == 0:
        raise DataError(f"data file '{path}' holds no tokens; pass a file with tokens in it")
    return tokens


def _load_npy(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError:
        raise DataError(f"data file '{path}' is not a readable .npy array; save token ids with "
                        "np.save(path, ids.astype(np.uint16))") from None
    if tokens.dtype not in TOKEN_DTYPES or tokens.ndim != 1:
        raise DataError(f"data file '{path}' holds a {tokens.ndim}-D {tokens.dtype} array; "
                        "save token ids as a 1-D uint16 or uint32 array")
    return tokens


def _load_bin(path: Path, dtype: np.dtype) -> np.ndarray:
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"token dtype {dtype} is not supported for .bin files; use uint16 or uint32")
    if path.stat().st_size % dtype.itemsize:
        raise DataError(f"data file '{path}' is {path.stat().st_size} bytes, not a whole number of "
                        f"{dtype} token ids; check the dtype it was written with")
    return np.memmap(path, dtype=dtype, mode="r")


class TokenBatches:
    """Deterministic (x, y) batches from a token array, with a held-out validation tail."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 val_fraction: float = 0.05, rank: int = 0, world_size: int = 1,
                 trained: np.ndarray | None = None) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ConfigError(f"batch_size {batch_size} and seq_len {seq_len} must both be at least 1")
        if batch_size % world_size:
            raise ConfigError(f"batch_size {batch_size} (the global batch) does not split evenly over "
                              f"{world_size} ranks; use a multiple of {world_size}")
        self.rows = slice(rank * batch_size // world_size, (rank + 1) * batch_size // world_size)
        if seed < 0:
            raise ConfigError(f"data seed {seed} is negative; use a seed >= 0")
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"val_fraction {val_fraction} must be in [0, 1)")
        n_val = int(len(tokens) * val_fraction)
        self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
        self.trained = trained  # which tokens are targets (fine-tuning examples); None: all
        if trained is not None and len(trained) != len(tokens):
            raise ConfigError(f"the trained mask has {len(trained)} entries for {len(tokens)} tokens; give one per token")
        for split, split_tokens in (("training", self.train), ("validation", self.val)):
            if len(split_tokens) < seq_len + 1 and (split == "training" or n_val > 0):
                raise DataError(
                    f"the corpus of {len(tokens)} tokens leaves {len(split_tokens)} for {split}, too short "
                    f"for seq_len {seq_len} (needs {seq_len + 1}); use a larger corpus or a smaller --seq-len"
                )
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self._starts = self._window_starts(0, len(self.train))
        self._val_starts = self._window_starts(len(self.train), len(self.val)) if n_val else self._starts
        if len(self._starts) == 0 or len(self._val_starts) == 0:
            raise DataError(f"no window of {seq_len + 1} tokens in the {'training' if len(self._starts) == 0 else 'validation'} "
                            "split has a completion or assistant token to train on; use a longer --seq-len or more data")
        self.n_windows = len(self._starts)
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    @cached_property
    def vocab_size_needed(self) -> int:
        """Largest token id + 1 (256 for byte tokens); scans uint16/uint32 data once."""
        if self.train.dtype == np.uint8:
            return 256
        return int(max(self.train.max(), self.val.max(initial=0))) + 1

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next global batch: x and y (x shifted by one), int64."""
        starts = []
        while len(starts) < self.batch_size:
            take = min(self.batch_size - len(starts), self.n_windows - self.position)
            starts.extend(self._starts[self._order[self.position: self.position + take]])
            self.position += take
            if self.position == self.n_windows:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        return self._gather(self.train, np.asarray(starts)[self.rows], 0)

    def val_batches(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first n validation batches: windows in order, cycling if the split is short."""
        if len(self.val) == 0:
            raise ConfigError("there is no validation split; set val_fraction above 0")
        window = np.arange(n * self.batch_size) % len(self._val_starts)
        return [self._gather(self.val, self._val_starts[starts[self.rows]], len(self.train))
                for starts in window.reshape(n, self.batch_size)]

    def state_dict(self) -> dict[str, int]:
        """The position in the batch order (JSON-serialisable), plus what it is only valid for."""
        return {"epoch": self.epoch, "position": self.position,
                "seq_len": self.seq_len, "n_windows": self.n_windows, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = (state.get("seq_len"), state.get("n_windows"), state.get("seed"))
        if saved != (self.seq_len, self.n_windows, self.seed):
            raise DataError(
                f"the saved data position is for seq_len {saved[0]}, {saved[1]} windows, seed {saved[2]}, "
                f"but this run has seq_len {self.seq_len}, {self.n_windows} windows, seed {self.seed}; "
                "resume with the same data, --seq-len and --seed"
            )
        if not 0 <= state.get("position", -1) < self.n_windows or state.get("epoch", -1) < 0:
            raise DataError(f"the saved data position {state} is out of range; the checkpoint is corrupt")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def _window_starts(self, offset: int, length: int) -> np.ndarray:
        """Where each window of a split starts (in the split): every seq_len-th token, keeping
        with a trained mask only the windows with a trained target."""
        starts = np.arange((length - 1) // self.seq_len) * self.seq_len
        if self.trained is None:
            return starts
        seen = np.concatenate([[0], np.cumsum(self.trained[offset + 1: offset + length], dtype=np.int64)])
        return starts[seen[starts + self.seq_len] > seen[starts]]  # targets of the window starting there

    def _gather(self, tokens: np.ndarray, starts: np.ndarray, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x and y of windows at `starts` of a split at `offset`: y is -100 where not trained."""
        index = starts[:, None] + np.arange(self.seq_len + 1)
        windows = torch.from_numpy(tokens[index].astype(np.int64))
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if self.trained is not None:
            y[~torch.from_numpy(self.trained[offset + index[:, 1:]].astype(bool))] = IGNORE_INDEX
        return x, y
