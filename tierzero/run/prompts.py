"""Prompts for generation: read from the command line or a file, and turned into token ids.

A prompts file is text, one prompt per line (blank lines skipped), or `.jsonl` records with a
`prompt` string or a chat's `messages` (the fine-tuning data's own shapes,
`tierzero.run.examples`). A `Codec` is one model's text: a Hugging Face directory's
`tokenizer.json` and, for chats, its chat template (rendered with the generation prompt, as
transformers' `apply_chat_template` does), or bytes (ids 0-255) for the built-in models and a
directory without a tokenizer. Ids are made as training made them: plain text as a data
document (the tokenizer's own special tokens), a `prompt` record or a rendered chat without
(the template writes its own). A plain prompt is framed as the run's data framed its text
(`Framing`): a user's turn for a run that trained on chats, a prompt record for one that
trained on prompt/completion pairs. It never touches a model or a device.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierzero.errors import DataError
from tierzero.run.corpus import TextTokenizer
from tierzero.run.examples import ChatTemplate, arrow_records, is_arrow_data, is_example
from tierzero.run.model_load import RunModel

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Prompt:
    """One prompt: plain text, a `prompt` record's text (`record`), or a chat's messages."""

    text: str | None = None
    messages: Messages | None = None
    record: bool = False

    def shown(self) -> str:
        """What samples.jsonl and the CLI print as the prompt."""
        return self.text if self.text is not None else json.dumps(self.messages)


def read_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of a text or `.jsonl` file, or a one-line error naming the file or line."""
    p = Path(path)
    if not p.is_file():
        raise DataError(
            f"prompts file '{p}' does not exist; pass a text file with one prompt per line "
            "or a .jsonl file of prompt or messages records"
        )
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(
            f"cannot read prompts file '{p}' as UTF-8 text ({e}); check the file"
        ) from None
    if p.suffix != ".jsonl":
        prompts = [Prompt(line) for line in lines if line.strip()]
    else:
        prompts = [
            _record(line, f"{p} line {n}") for n, line in enumerate(lines, start=1) if line.strip()
        ]
    if not prompts:
        raise DataError(f"prompts file '{p}' holds no prompt; write one per line")
    return prompts


def _record(line: str, where: str) -> Prompt:
    try:
        record = json.loads(line)
    except ValueError:
        raise DataError(f"{where} is not JSON; write one JSON object per line") from None
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        messages = record["messages"]
        if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise DataError(f"{where}: 'messages' is not a list of {{'role', 'content'}} objects")
        return Prompt(messages=messages)
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        if not record["prompt"]:
            raise DataError(f"{where}: the prompt is empty; give it some text")
        return Prompt(record["prompt"], record=True)
    raise DataError(f"{where} has neither a 'prompt' string nor 'messages'; write one of them")


class Framing(str, enum.Enum):
    """How a run's data framed its text, so plain prompts are framed the same way."""

    TEXT = "text"  # documents: the tokenizer's own special tokens
    CHAT = "chat"  # `messages` records: a plain prompt is a user's turn in the chat template
    PAIRS = "pairs"  # `prompt`/`completion` records: a plain prompt is a prompt, no special tokens


def framing_of(data: str | None) -> Framing:
    """What a run's `--data` is, from its first record (text when it is not records, or gone)."""
    path = Path(data) if data else None
    if path is None or not path.exists() or not (path.suffix == ".jsonl" or is_arrow_data(path)):
        return Framing.TEXT
    if is_arrow_data(path):
        first = next(iter(arrow_records(path)), None)
    else:
        with open(path, encoding="utf-8") as f:
            line = next((line for line in f if line.strip()), "")
        try:
            first = json.loads(line) if line else None
        except ValueError:
            return Framing.TEXT
    if isinstance(first, dict) and "messages" in first:
        return Framing.CHAT
    return Framing.PAIRS if is_example(first) else Framing.TEXT


class Codec:
    """One model's text and token ids: its tokenizer (None: bytes), chat template and the ids
    that end a reply."""

    def __init__(
        self,
        tokenizer: TextTokenizer | None,
        vocab_size: int,
        stop_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        eos = tokenizer.eos_id if tokenizer is not None else None
        self.stop_ids = stop_ids | ({eos} if eos is not None else set())
        self._loaded: Any = None
        self._template = ChatTemplate(tokenizer.path.parent) if tokenizer is not None else None

    @classmethod
    def for_model(cls, model: RunModel) -> Codec:
        """A run's model's codec. Its replies end at any end-of-sequence id its directory names
        (config.json's and generation_config.json's `eos_token_id`, one or a list: a chat
        model's end of turn is often only in the latter), as transformers' `generate` stops."""
        stop: set[int] = set()
        if model.hf_model is not None:
            for name in ("config.json", "generation_config.json"):
                stop |= _eos_ids(model.hf_model.path / name)
        return cls(model.tokenizer, model.vocab_size, frozenset(stop))

    def encode(self, prompt: Prompt, framing: Framing = Framing.TEXT) -> list[int]:
        """`prompt`'s ids, checked against the vocabulary; plain text framed by `framing`."""
        chat = framing is Framing.CHAT
        messages = (
            prompt.messages
            if prompt.messages is not None
            else ([{"role": "user", "content": prompt.text}] if chat else None)
        )
        if messages is not None:
            if self._template is None:
                raise DataError(
                    "chat prompts need an hf: model's tokenizer.json and chat template; this model "
                    "reads bytes: give plain prompts (drop --chat)"
                )
            ids = self._tokens(
                self._template.render(messages, add_generation_prompt=True),
                special=False,
            )
        elif not prompt.text:
            raise DataError("a prompt is empty; give every prompt some text")
        elif self.tokenizer is None:
            ids = list(prompt.text.encode("utf-8"))
        else:
            ids = self._tokens(prompt.text, special=not (prompt.record or framing is Framing.PAIRS))
        beyond = [i for i in ids if i >= self.vocab_size]
        if beyond:
            raise DataError(
                f"a prompt has token id {beyond[0]}, beyond the model's vocabulary of "
                f"{self.vocab_size}; use the model's own tokenizer"
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._tokenizer().decode(ids, skip_special_tokens=True)

    def _tokens(self, text: str, special: bool) -> list[int]:
        return list(self._tokenizer().encode(text, add_special_tokens=special).ids)

    def _tokenizer(self) -> Any:
        if self._loaded is None:
            assert self.tokenizer is not None
            self._loaded = self.tokenizer.load()
        return self._loaded


def _eos_ids(path: Path) -> set[int]:
    """The `eos_token_id` (an id or a list of them) of a model directory's JSON file; none when
    it has no such file or key."""
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return set()
    ids = eos if isinstance(eos, list) else [eos]
    return {i for i in ids if isinstance(i, int) and not isinstance(i, bool)}
