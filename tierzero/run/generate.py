"""Generation: new tokens for a batch of prompts, one pass over the units per token.

A `Decoder` is a model and the pass that runs it: through an `Engine` (the weights stream
through the tiers as in training, each unit fetched for its turn or held where the budget
allows) or, for the in-memory reference trainer, the model as it is. The model makes its own
decode cache (`decode_cache`: the built-in `KVCache`, or a Hugging Face `DynamicCache` through
`tierzero.hf.decode`), kept on the compute device between passes, so after the prompts' pass
(every prompt at once, left-padded to one length) each new token is one more pass for every
row at once, never one per prompt.

Greedy by default (the highest logit, the first on ties, as transformers' `generate` picks);
with a temperature, tokens are drawn from the softmax of the logits over it, cut to the top-p
nucleus, from a generator seeded by `Sampling.seed`, so a seed repeats its draws. A row stops
at an id that ends a reply (the model's end-of-sequence ids; it keeps it); the pass runs on while
another row has not.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tierzero.config import DType
from tierzero.errors import ConfigError

if TYPE_CHECKING:
    from tierzero.engine import Engine

# one pass over every unit: the model's keyword arguments -> each row's last logits (B, 1, V)
Pass = Callable[[dict[str, Any]], torch.Tensor]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: `temperature` 0 is greedy."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"--max-new-tokens must be an integer >= 1, got {n!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ConfigError(
                f"--temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}"
            )
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"--top-p must be in (0, 1] (1: the whole distribution), got {self.top_p!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Decoder:
    """A model in eval mode and the pass that runs it without grad."""

    model: nn.Module
    forward: Pass
    cache_nbytes: int = 0  # the last generation's decode cache (on the device, beside the pools)

    @classmethod
    def through(cls, engine: Engine) -> Decoder:
        """Passes through `engine`'s tiers (its eval swap plan: every unit once, in order)."""
        return cls(engine.parts.model, engine.forward)

    @classmethod
    def in_memory(cls, model: nn.Module, device: torch.device, dtype: DType) -> Decoder:
        """Passes of a model held whole on `device`, under the reference trainer's autocast."""

        def forward(batch: dict[str, Any]) -> torch.Tensor:
            moved = {
                k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
            }
            low = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16}.get(dtype)
            with torch.autocast(device.type, dtype=low) if low else contextlib.nullcontext():
                return model(**moved)

        return cls(model, forward)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Dropout off and no grad inside; the model's mode restored after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)


def generate(
    decoder: Decoder,
    prompts: list[list[int]],
    sampling: Sampling,
    stop_ids: Collection[int] = (),
    scores: list[torch.Tensor] | None = None,
    pad_id: int = 0,
) -> list[list[int]]:
    """Each prompt's new token ids: up to `sampling.max_new_tokens`, or through the first of
    `stop_ids`. `scores`, when given, gets each pass's last logits (B, V) in fp32 on the host."""
    empty = [i + 1 for i, p in enumerate(prompts) if not p]
    if not prompts or empty:
        raise ConfigError(
            f"prompt {empty[0]} is empty; give every prompt some text"
            if empty
            else "no prompts were given; pass --prompt TEXT"
        )
    longest = max(len(p) for p in prompts)
    pad = [longest - len(p) for p in prompts]
    ids = torch.tensor([[pad_id] * n + p for n, p in zip(pad, prompts)], dtype=torch.long)
    cache = decoder.model.decode_cache(pad, longest + sampling.max_new_tokens)
    generator = torch.Generator().manual_seed(sampling.seed)
    new: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    with decoder.evaluating():
        for _ in range(sampling.max_new_tokens):
            logits = decoder.forward(cache.inputs(ids))[:, -1].float().cpu()  # host sync, per token
            if scores is not None:
                scores.append(logits)
            chosen = next_tokens(logits, sampling, generator)
            for row, token in enumerate(chosen.tolist()):
                if not done[row]:
                    new[row].append(token)
                    done[row] = token in stop_ids
            if all(done):
                break
            ids = chosen[:, None]
    decoder.cache_nbytes = cache.nbytes
    return new


def next_tokens(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator
) -> torch.Tensor:
    """Each row's next token from its fp32 `logits` (B, V) on the host."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered  # the mass of the tokens ranked above each
        ordered = ordered.masked_fill(before >= sampling.top_p, 0.0)  # the top one always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
