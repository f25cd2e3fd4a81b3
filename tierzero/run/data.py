"""Token data: loading token arrays and drawing deterministic, resumable batches from them.

Owns the default corpus (the Python standard library's own sources: real text, on every
machine, nothing downloaded or bundled), the token-file formats, and the batch order. It never
touches a model or a device: batches are CPU int64 tensors.

Batch order: the training split is cut into non-overlapping windows of seq_len + 1 tokens
(consecutive windows share one token, so every token is a target once per epoch). Each epoch
visits every window once, in a permutation drawn from (seed, epoch). The position in that
order is the whole state, so a resumed run sees exactly the batches an uninterrupted one would.

Fine-tuning examples come with a `trained` mask, one entry per token (`tierzero.run.corpus`):
a target that is not trained is -100 in y, which the loss ignores (a step's loss is the mean
over its trained targets), and a window without a trained target is never drawn. Given where
each example starts (`examples`), windows are whole examples packed together instead of every
seq_len-th token (`tierzero.run.packing`); the targets past a window's last example are -100.

Validation: the first windows that hold `eval_tokens` tokens, in batches of the training
batch's rows (the last one filled with rows whose targets are all -100), so the set, and the
loss over its trained targets, is the same for any batch size and number of ranks. They come
from held-out data of their own (`held_out`: `--val-data`), or from a split off the corpus's
end: `val_fraction` of it when asked for (refused if too small to hold a window), else 5%
where the corpus can spare it -- a corpus too small for a split nobody asked for trains
without one, and `note` says so.

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
from tierzero.run.packing import pack

TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.uint32))
DEFAULT_VAL_FRACTION = 0.05  # the split held out when none is asked for, where the corpus spares it
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
        raise DataError(
            f"found no .py files under the standard library at '{root}'; "
            "pass a text file with --data"
        )
    return np.frombuffer(bytes(text[:max_bytes]), dtype=np.uint8)


def _stdlib_sources(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        # sorted in place: walk order
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def load_tokens(path: str | os.PathLike, dtype: DTypeLike = np.uint16) -> np.ndarray:
    """Memory-mapped tokens of a file: `.npy` (uint16/uint32 array), `.bin` (raw ids of `dtype`),
    anything else as text (one uint8 token per byte)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"data file '{path}' does not exist; pass an existing .txt, .bin or .npy file, "
            "or leave --data out to use the default corpus"
        )
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
        raise DataError(
            f"cannot read data file '{path}' ({e.strerror or e}); check its permissions"
        ) from None
    if tokens.size == 0:
        raise DataError(f"data file '{path}' holds no tokens; pass a file with tokens in it")
    return tokens


def _load_npy(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError:
        raise DataError(
            f"data file '{path}' is not a readable .npy array; save token ids with "
            "np.save(path, ids.astype(np.uint16))"
        ) from None
    if tokens.dtype not in TOKEN_DTYPES or tokens.ndim != 1:
        raise DataError(
            f"data file '{path}' holds a {tokens.ndim}-D {tokens.dtype} array; "
            "save token ids as a 1-D uint16 or uint32 array"
        )
    return tokens


def _load_bin(path: Path, dtype: np.dtype) -> np.ndarray:
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(
            f"token dtype {dtype} is not supported for .bin files; use uint16 or uint32"
        )
    if path.stat().st_size % dtype.itemsize:
        raise DataError(
            f"data file '{path}' is {path.stat().st_size} bytes, not a whole number of "
            f"{dtype} token ids; check the dtype it was written with"
        )
    return np.memmap(path, dtype=dtype, mode="r")


class TokenBatches:
    """Deterministic (x, y) batches from a token array, with a held-out validation tail."""

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        seed: int,
        val_fraction: float | None = None,
        rank: int = 0,
        world_size: int = 1,
        trained: np.ndarray | None = None,
        examples: np.ndarray | None = None,
    ) -> None:
        """`val_fraction`: the end of `tokens` held out for validation (0: none); None: 5% where
        the corpus spares a window for it, else none (`note` says so)."""
        if batch_size < 1 or seq_len < 1:
            raise ConfigError(
                f"batch_size {batch_size} and seq_len {seq_len} must both be at least 1"
            )
        if batch_size % world_size:
            raise ConfigError(
                f"batch_size {batch_size} (the global batch) does not split evenly over "
                f"{world_size} ranks; use a multiple of {world_size}"
            )
        self.rows = slice(rank * batch_size // world_size, (rank + 1) * batch_size // world_size)
        if seed < 0:
            raise ConfigError(f"data seed {seed} is negative; use a seed >= 0")
        if val_fraction is not None and not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"val_fraction {val_fraction} must be in [0, 1)")
        self.trained = trained  # which tokens are targets (fine-tuning examples); None: all
        if trained is not None and len(trained) != len(tokens):
            raise ConfigError(
                f"the trained mask has {len(trained)} entries for {len(tokens)} tokens; "
                "give one per token"
            )
        self.examples = examples  # where each example starts, then the end; None: plain text
        if examples is not None and (examples[0] != 0 or examples[-1] != len(tokens)):
            raise ConfigError(
                f"the example offsets run from {examples[0]} to {examples[-1]}, not over the "
                f"{len(tokens)} tokens; give each example's first offset, then the end"
            )
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.note: str | None = None  # why there is no validation split (a small corpus)
        self._held_out: TokenBatches | None = None  # `--val-data`'s batches (`held_out`)
        fraction = DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
        why = self._split(tokens, self._split_at(len(tokens), int(len(tokens) * fraction)))
        if why is not None and val_fraction is None and len(self.val):  # nobody asked for a split
            self.note = (
                f"training without evaluation: with 5% held out for validation, {why[0]}; pass "
                "--val-data to evaluate"
            )
            why = self._split(tokens, len(tokens))
        if why is not None:
            problem, fix = why
            hint = (
                "lower --val-fraction, "
                if "training" in problem and len(self.val)
                else "raise --val-fraction, pass --val-data, "
                if "validation" in problem
                else ""
            )
            raise DataError(f"{problem}; {hint}{fix}")
        self.n_windows = len(self._windows[0])
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _split(self, tokens: np.ndarray, split: int) -> tuple[str, str] | None:
        """Split `tokens` at `split` into training and validation and cut both into windows;
        what leaves one of them unusable and its fix (None: both usable, or validation empty)."""
        self.train, self.val = tokens[:split], tokens[split:]
        for name, part in (("training", self.train), ("validation", self.val)):
            if len(part) < self.seq_len + 1 and (name == "training" or len(self.val)):
                return (
                    f"the corpus of {len(tokens)} tokens leaves {len(part)} for {name}, "
                    f"too short for seq_len {self.seq_len} (needs {self.seq_len + 1})",
                    "use a larger corpus or a smaller --seq-len",
                )
        self._windows = self._split_windows(0, len(self.train))
        self._val_windows = (
            self._split_windows(len(self.train), len(self.val)) if len(self.val) else self._windows
        )
        for name, (firsts, _) in (("training", self._windows), ("validation", self._val_windows)):
            if len(firsts) == 0:
                return (
                    f"no window of {self.seq_len + 1} tokens in the {name} split has a "
                    "completion or assistant token to train on",
                    "use a longer --seq-len or more data",
                )
        return None

    def held_out(
        self,
        tokens: np.ndarray,
        trained: np.ndarray | None = None,
        examples: np.ndarray | None = None,
        source: str = "--val-data",
    ) -> None:
        """Validate on `tokens` (`source`'s, with its own trained mask and examples as the corpus
        has them) instead of a split of the corpus."""
        if len(tokens) < self.seq_len + 1:
            raise DataError(
                f"{source} holds {len(tokens)} tokens, too short for seq_len {self.seq_len} "
                f"(needs {self.seq_len + 1}); pass more validation data or a smaller --seq-len"
            )
        try:
            self._held_out = TokenBatches(
                tokens,
                self.batch_size,
                self.seq_len,
                self.seed,
                0.0,
                trained=trained,
                examples=examples,
            )
        except DataError:
            raise DataError(
                f"{source} has no window of {self.seq_len + 1} tokens with a completion or "
                "assistant token to train on; pass validation records with replies, or a "
                "longer --seq-len"
            ) from None
        self._held_out.rows = self.rows  # this rank's rows of every batch, as of the corpus's
        self.note = None

    @property
    def has_validation(self) -> bool:
        """Whether there is a validation set: held-out data, or a split of the corpus."""
        return self._held_out is not None or len(self.val) > 0

    @cached_property
    def vocab_size_needed(self) -> int:
        """Largest token id + 1 (256 for byte tokens); scans uint16/uint32 data once."""
        if self.train.dtype == np.uint8:
            return 256
        return int(max(self.train.max(), self.val.max(initial=0))) + 1

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next global batch: x and y (x shifted by one), int64."""
        chosen = []
        while len(chosen) < self.batch_size:
            take = min(self.batch_size - len(chosen), self.n_windows - self.position)
            chosen.extend(self._order[self.position : self.position + take])
            self.position += take
            if self.position == self.n_windows:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        rows = np.asarray(chosen)[self.rows]
        firsts, lasts = self._windows
        return self._gather(self.train, firsts[rows], lasts[rows], 0)

    def val_batches(self, eval_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's rows of the validation set: its first windows, in order, that hold
        `eval_tokens` tokens (all of them if the set is shorter), batch_size rows a batch."""
        if self._held_out is not None:
            held = self._held_out
            return held._eval_batches(held.train, held._windows, 0, eval_tokens)
        if len(self.val) == 0:
            raise ConfigError(
                "there is no validation split; set val_fraction above 0 or pass val_data"
            )
        return self._eval_batches(self.val, self._val_windows, len(self.train), eval_tokens)

    def _eval_batches(
        self,
        tokens: np.ndarray,
        windows: tuple[np.ndarray, np.ndarray],
        offset: int,
        eval_tokens: int,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        firsts, lasts = windows
        n = min(len(firsts), -(-eval_tokens // self.seq_len))
        pad = -n % self.batch_size  # rows with no target: the same set for every batch size
        firsts = np.concatenate([firsts[:n], np.repeat(firsts[:1], pad)])
        lasts = np.concatenate([lasts[:n], np.repeat(firsts[:1], pad)])
        return [
            self._gather(
                tokens,
                firsts[i : i + self.batch_size][self.rows],
                lasts[i : i + self.batch_size][self.rows],
                offset,
            )
            for i in range(0, n + pad, self.batch_size)
        ]

    def state_dict(self) -> dict[str, int]:
        """The position in the batch order (JSON-serialisable), plus what it is only valid for."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seq_len": self.seq_len,
            "n_windows": self.n_windows,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = (state.get("seq_len"), state.get("n_windows"), state.get("seed"))
        if saved != (self.seq_len, self.n_windows, self.seed):
            raise DataError(
                f"the saved data position is for seq_len {saved[0]}, {saved[1]} windows, "
                f"seed {saved[2]}, but this run has seq_len {self.seq_len}, "
                f"{self.n_windows} windows, seed {self.seed}; "
                "resume with the same data, --seq-len and --seed"
            )
        if not 0 <= state.get("position", -1) < self.n_windows or state.get("epoch", -1) < 0:
            raise DataError(
                f"the saved data position {state} is out of range; the checkpoint is corrupt"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def _split_at(self, length: int, n_val: int) -> int:
        """Where validation starts: `n_val` tokens from the end, moved to the next example's
        start."""
        if self.examples is None or n_val == 0:
            return length - n_val
        after = self.examples[np.searchsorted(self.examples, length - n_val)]
        return int(after) if after < length else int(self.examples[-2])

    def _split_windows(self, offset: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Each window of a split (offsets in the split): where it starts and where its last
        target's token ends. Plain tokens: every seq_len-th token, windows of seq_len + 1. With
        examples: whole examples packed together. With a trained mask only the windows with a
        trained target are kept."""
        window = self.seq_len + 1
        if self.examples is None:
            firsts = np.arange((length - 1) // self.seq_len) * self.seq_len
            lasts = firsts + window
        else:
            inside = (
                self.examples[(self.examples >= offset) & (self.examples <= offset + length)]
                - offset
            )
            firsts, lasts = pack(inside, window)
            if len(firsts) and (lasts - firsts).max() > window:
                raise ConfigError(
                    f"an example is longer than a window of {window} tokens; pass examples through "
                    "tierzero.run.packing.fit_examples first"
                )
        if self.trained is None:
            return firsts, lasts
        seen = np.concatenate(
            [[0], np.cumsum(self.trained[offset + 1 : offset + length], dtype=np.int64)]
        )
        keep = seen[lasts - 1] > seen[firsts]  # the window's targets: tokens first + 1 .. last - 1
        return firsts[keep], lasts[keep]

    def _gather(
        self, tokens: np.ndarray, firsts: np.ndarray, lasts: np.ndarray, offset: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x and y of the windows at `firsts` of a split at `offset`: y is -100 where not trained
        and past each window's `lasts`. x and y are separate tensors (as views of one buffer, a
        one-row batch's masked targets would overwrite its inputs)."""
        positions = np.arange(self.seq_len + 1)
        index = np.minimum(firsts[:, None] + positions, len(tokens) - 1)  # past the split: masked
        x = torch.from_numpy(tokens[index[:, :-1]].astype(np.int64))
        y = torch.from_numpy(tokens[index[:, 1:]].astype(np.int64))
        if self.trained is None and (lasts - firsts == len(positions)).all():
            return x, y
        keep = positions[1:] < (lasts - firsts)[:, None]
        if self.trained is not None:
            keep &= self.trained[offset + index[:, 1:]].astype(bool)
        y[~torch.from_numpy(keep)] = IGNORE_INDEX
        return x, y
