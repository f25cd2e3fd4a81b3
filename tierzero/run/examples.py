"""Fine-tuning examples: records that say which tokens to train on, as ids and a trained mask.

A record is a chat (`messages`: a list of {"role", "content"}, rendered by the tokenizer's own
chat template, as transformers' `apply_chat_template` renders it) or an instruction pair
(`prompt` and `completion`, joined, then the end-of-sequence id). Only the assistant turns /
the completion (and its end-of-sequence id) are *trained*: every other token is context, and
its target is masked (-100) by `TokenBatches`, so the loss is the mean over trained tokens.

Which tokens are trained comes from character spans of the rendered text, mapped to tokens by
the tokenizer's offsets: a token that carries any character of a span is trained (so a reply's
first token that BPE merged with the space ending "assistant: " is trained, not taken for
context). This is transformers' `return_assistant_tokens_mask` rule. A template that marks
replies with `{% generation %}` gives the spans itself (and the mask is transformers' own);
otherwise the chat is rendered up to each assistant turn (with the generation prompt) and
through it, and the characters between the two are the turn's. Templates that do not render a
chat's beginning the same way when it is cut short are refused rather than masked wrongly.
Each record is one example: `Examples.bounds` says where each starts (`tierzero.run.packing`).

Records come from a `.jsonl` file, Parquet files, or a `datasets` `save_to_disk` directory
(Arrow files); the last two need `pyarrow` (`pip install 'tierzero[data]'`) and are read one
record batch at a time, never whole. It never touches a model or a device.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tierzero.errors import DataError
from tierzero.run.packing import Examples

BATCH_RECORDS = 1024  # records per Arrow batch read and tokenized at once
ARROW_MARKER = "state.json"  # what `Dataset.save_to_disk` writes beside its .arrow files
# transformers' test for a template that marks replies
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def is_example(record: Any) -> bool:
    return isinstance(record, dict) and (
        "messages" in record or {"prompt", "completion"} <= record.keys()
    )


def is_arrow_data(path: Path) -> bool:
    return path.suffix == ".parquet" or (path.is_dir() and (path / ARROW_MARKER).is_file())


def arrow_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a Parquet file, a folder of them, or a `save_to_disk` directory, one
    Arrow record batch at a time."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"reading {path.name} needs pyarrow; pip install 'tierzero[data]'"
        ) from None
    try:
        if path.is_dir() and (path / ARROW_MARKER).is_file():
            state = json.loads((path / ARROW_MARKER).read_text())
            files = [path / f["filename"] for f in state.get("_data_files", [])] or sorted(
                path.glob("*.arrow")
            )
            for f in files:
                with pa.memory_map(str(f)) as source:
                    for batch in pa.ipc.open_stream(source):
                        yield from batch.to_pylist()
            return
        files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
        for f in files:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=BATCH_RECORDS):
                yield from batch.to_pylist()
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:
        raise DataError(
            f"cannot read '{path}' as Parquet or a datasets save_to_disk directory ({e}); "
            "check the files"
        ) from None


class ChatTemplate:
    """The model directory's chat template (transformers reads it), rendering chats to text."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._tokenizer: Any = None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return self._loaded().apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def generation_spans(
        self, messages: list[dict[str, Any]]
    ) -> tuple[str, list[tuple[int, int]]] | None:
        """The rendered chat and the character spans its `{% generation %}` blocks cover, as
        transformers finds them for `return_assistant_tokens_mask`; None: the template has none."""
        tokenizer = self._loaded()
        template = tokenizer.get_chat_template()
        if not GENERATION.search(template):
            return None
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, spans = render_jinja_template(
            conversations=[messages],
            chat_template=template,
            return_assistant_tokens_mask=True,
            **tokenizer.special_tokens_map,
        )
        return rendered[0], [tuple(span) for span in spans[0]]

    def _loaded(self) -> Any:
        if self._tokenizer is None:
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(
                    self.model_dir, local_files_only=True
                )
            except (ImportError, OSError, ValueError) as e:
                raise DataError(
                    f"chat records need the tokenizer of {self.model_dir} through transformers "
                    f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                    "pip install 'tierzero[hf]'"
                ) from None
            if not self._tokenizer.chat_template:
                raise DataError(
                    f"{self.model_dir} has no chat template (tokenizer_config.json's chat_template "
                    "or chat_template.jinja); use prompt/completion records, or add the template"
                )
        return self._tokenizer


def encode_examples(
    records: Iterable[dict[str, Any]],
    tokenizer: Any,
    eos_id: int | None,
    template: ChatTemplate | None,
    source: str,
) -> Examples:
    """Token ids of every record, end to end, whether each is trained, and where each record
    starts."""
    ids: list[int] = []
    trained: list[np.ndarray] = []
    bounds = [0]
    batch: list[tuple[str, list[tuple[int, int]], bool]] = []

    def flush() -> None:
        for (_, spans, eos), encoding in zip(
            batch, tokenizer.encode_batch([t for t, _, _ in batch], add_special_tokens=False)
        ):
            ids.extend(encoding.ids)
            trained.append(
                trained_tokens(np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2), spans)
            )
            if eos and eos_id is not None:
                ids.append(eos_id)
                trained.append(np.ones(1, dtype=np.uint8))
            bounds.append(len(ids))
        batch.clear()

    for number, record in enumerate(records, start=1):
        batch.append(_rendered(record, template, f"{source} record {number}"))
        if len(batch) == BATCH_RECORDS:
            flush()
    flush()
    return Examples(
        np.asarray(ids, dtype=np.uint32),
        np.concatenate([np.zeros(0, np.uint8), *trained]),
        np.asarray(bounds, dtype=np.int64),
    )


def trained_tokens(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Whether each token (its character `offsets`, start and end) carries a character of a
    span: transformers' `return_assistant_tokens_mask` rule. uint8 0/1."""
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        mask |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    return mask.astype(np.uint8)


def _rendered(
    record: dict[str, Any], template: ChatTemplate | None, where: str
) -> tuple[str, list[tuple[int, int]], bool]:
    """The record's text, the character spans to train on, and whether an end-of-sequence id
    follows."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m for m in messages
        ):
            raise DataError(f"{where}: 'messages' is not a list of {{'role', 'content'}} objects")
        if template is None:
            raise DataError(
                f"{where} is a chat, which needs the model's tokenizer and chat template; "
                "train an hf: model whose directory has them"
            )
        marked = template.generation_spans(messages)
        if marked is not None:
            return marked[0], marked[1], False
        text = template.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = template.render(messages[:i], add_generation_prompt=True) if i else ""
            through = template.render(messages[: i + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise DataError(
                    f"{where}: the chat template renders the chat's first turns differently "
                    "when it is cut short, so the assistant's tokens cannot be found; "
                    "use prompt/completion"
                )
            spans.append((len(before), len(through)))
        return text, spans, False
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DataError(f"{where}: 'prompt' and 'completion' must both be strings")
    return prompt + completion, [(len(prompt), len(prompt) + len(completion))], True
