"""Fine-tuning data: what `--data` names, read into one token array for `TokenBatches`.

`--data` is a text file, a folder of text files, a `.jsonl` file of records with a text field
(`--text-field`, default `text`), Parquet files or a `datasets` `save_to_disk` directory of
such records, or token ids (`.bin`/`.npy`, see `tierzero.run.data`). Records with `messages`
or `prompt`/`completion` are fine-tuning examples (`tierzero.run.examples`): `read_data` also
says which of their tokens are trained and where each example starts. Text is
tokenized by the model directory's own `tokenizer.json` (the `tokenizers` library) when there
is one -- each document's ids, then the model's end-of-sequence id where its config names
one -- else read as bytes (ids 0-255). Every id is checked against the model's vocabulary
here, where the file it came from is known, so a mismatch is one sentence naming that file.
It never touches a model or a device.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierzero.errors import DataError
from tierzero.run.data import default_corpus, load_tokens
from tierzero.run.examples import (
    ChatTemplate,
    arrow_records,
    encode_examples,
    is_arrow_data,
    is_example,
)
from tierzero.run.packing import Examples

TOKEN_SUFFIXES = (".bin", ".npy")


@dataclass
class TextTokenizer:
    """A model's `tokenizer.json`, and the id that ends each document (None: nothing added)."""

    path: Path
    eos_id: int | None = None

    def load(self) -> Any:
        """The `tokenizers.Tokenizer` of `path`."""
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                "tokenizing text with a model's tokenizer.json needs tokenizers; "
                "pip install 'tierzero[hf]'"
            ) from None
        try:
            return Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises plain Exceptions for unreadable files
            raise DataError(
                f"{self.path} is not a tokenizer the tokenizers library reads "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); replace it with "
                "the model's own tokenizer.json"
            ) from None

    def encode(self, documents: list[str]) -> np.ndarray:
        ids: list[int] = []
        for encoding in self.load().encode_batch(documents):
            ids.extend(encoding.ids)
            if self.eos_id is not None:
                ids.append(self.eos_id)
        return np.asarray(ids, dtype=np.uint32)


def read_data(
    data: str | None,
    vocab_size: int,
    tokenizer: TextTokenizer | None = None,
    text_field: str = "text",
) -> tuple[np.ndarray, Examples | None]:
    """The tokens of `data` and, for fine-tuning examples (`tierzero.run.examples`), the same
    tokens as examples: which are trained and where each example starts (None: plain text)."""
    path = Path(data) if data is not None else None
    if path is None or not (path.suffix == ".jsonl" or is_arrow_data(path)):
        return read_corpus(data, vocab_size, tokenizer, text_field), None
    if not path.exists():
        raise DataError(
            f"data '{path}' does not exist; pass a .jsonl file, Parquet files or a "
            "datasets save_to_disk directory"
        )
    numbered = (
        enumerate(arrow_records(path), start=1) if is_arrow_data(path) else _json_objects(path)
    )
    where = "record" if is_arrow_data(path) else "line"
    first = next(numbered, None)
    numbered = itertools.chain([first] if first is not None else [], numbered)
    if first is None or not is_example(first[1]):
        documents = [_text(r, text_field, f"{path} {where} {i}") for i, r in numbered]
        if not any(documents):
            raise DataError(f"data '{path}' holds no text; pass files with text in them")
        tokens = (
            tokenizer.encode(documents)
            if tokenizer is not None
            else np.frombuffer("\n".join(documents).encode(), dtype=np.uint8)
        )
        return _checked(tokens, vocab_size, str(path), tokenizer), None
    if tokenizer is None:
        raise DataError(
            f"data '{path}' holds prompt/completion or chat records, which need the model's "
            "tokenizer.json; train an hf: model whose directory has one"
        )
    examples = encode_examples(
        (r for _, r in numbered),
        tokenizer.load(),
        tokenizer.eos_id,
        ChatTemplate(tokenizer.path.parent),
        str(path),
    )
    if not examples.trained.any():
        raise DataError(
            f"data '{path}' has no completion or assistant tokens to train on; check its records"
        )
    ids = _checked(examples.ids, vocab_size, str(path), tokenizer)
    return ids, Examples(ids, examples.trained, examples.bounds)


def read_corpus(
    data: str | None,
    vocab_size: int,
    tokenizer: TextTokenizer | None = None,
    text_field: str = "text",
) -> np.ndarray:
    """The tokens of `data` (None: the standard library's sources), checked against `vocab_size`."""
    if data is None:
        if tokenizer is None:
            return _checked(default_corpus(), vocab_size, "the default corpus")
        text = default_corpus().tobytes().decode("utf-8", errors="replace")
        return _checked(tokenizer.encode([text]), vocab_size, "the default corpus", tokenizer)
    path = Path(data)
    if path.suffix in TOKEN_SUFFIXES or (
        tokenizer is None and path.suffix != ".jsonl" and not path.is_dir()
    ):
        return _checked(load_tokens(path), vocab_size, str(path))  # memory-mapped ids or bytes
    if not path.exists():
        raise DataError(
            f"data '{path}' does not exist; pass a text file, a folder of text files, "
            "a .jsonl file or .bin/.npy token ids"
        )
    documents = list(_documents(path, text_field))
    if not any(documents):
        raise DataError(f"data '{path}' holds no text; pass files with text in them")
    if tokenizer is not None:
        return _checked(tokenizer.encode(documents), vocab_size, str(path), tokenizer)
    tokens = np.frombuffer("\n".join(documents).encode(), dtype=np.uint8)
    return _checked(tokens, vocab_size, str(path))


def _documents(path: Path, text_field: str) -> Iterator[str]:
    """Each document of a file or folder: a whole text file, or one `.jsonl` record's text."""
    files = (
        sorted(f for f in path.rglob("*") if f.is_file() and not _hidden(f, path))
        if path.is_dir()
        else [path]
    )
    for f in files:
        if f.suffix in TOKEN_SUFFIXES:
            raise DataError(
                f"data folder '{path}' holds token file {f.name}; pass token files on their "
                "own, or a folder of text files only"
            )
        try:
            if f.suffix == ".jsonl":
                yield from _records(f, text_field)
            else:
                yield f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(
                f"data file '{f}' is not UTF-8 text; pass text files, or token ids as .bin/.npy"
            ) from None
        except OSError as e:
            raise DataError(
                f"cannot read data file '{f}' ({e.strerror or e}); check its permissions"
            ) from None


def _records(path: Path, text_field: str) -> Iterator[str]:
    for number, record in _json_objects(path):
        yield _text(record, text_field, f"{path} line {number}")


def _json_objects(path: Path) -> Iterator[tuple[int, Any]]:
    """Each record of a .jsonl file, with its line number."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except ValueError:
                raise DataError(
                    f"{path} line {number} is not JSON; write one JSON object per line"
                ) from None


def _text(record: Any, text_field: str, where: str) -> str:
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(
            f"{where} has no string field '{text_field}'; name the field that holds the text "
            "with --text-field"
        )
    return text


def _hidden(f: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in f.relative_to(root).parts)


def _checked(
    tokens: np.ndarray, vocab_size: int, source: str, tokenizer: TextTokenizer | None = None
) -> np.ndarray:
    """`tokens`, or a one-line error naming `source` if an id is beyond the vocabulary."""
    if tokens.size == 0:
        raise DataError(f"data '{source}' holds no tokens; pass data with text or token ids in it")
    top = 255 if tokens.dtype == np.uint8 else int(tokens.max())
    if top >= vocab_size:
        how = (
            f"tokenized by {tokenizer.path}"
            if tokenizer is not None
            else "read as bytes"
            if tokens.dtype == np.uint8
            else "stored"
        )
        raise DataError(
            f"data '{source}' {how} has token id {top}, beyond the model's vocabulary of "
            f"{vocab_size}; use data tokenized for this model, or a model with a larger vocabulary"
        )
    if tokens.dtype == np.uint32 and vocab_size <= 1 << 16:
        tokens = tokens.astype(np.uint16)  # half the memory for the batches' windows
    return tokens
