"""How long a sequence a Hugging Face model can run: `--seq-len` against its positions.

Families encode positions in three ways, and a sequence past the model's positions fails, or
does not, accordingly (checked on the built model, so a family is judged by what it builds):

- a table with one row per position: learned (GPT-2's `wpe`, OPT's and BioGPT's offset
  `embed_positions`, GPT-Neo, GPT-BigCode) or a rotary table computed once for
  `max_position_embeddings` rows (GPT-J's and CodeGen's `embed_positions`) -- a longer sequence
  indexes past it (an IndexError in the forward): refused;
- a bias built at a fixed length (MPT's ALiBi, `max_seq_len` long) -- a longer sequence does
  not broadcast against it (a size mismatch): refused;
- rotary embeddings computed for any position (LLaMA, Mistral, Qwen, Gemma, Phi, NeoX, Falcon,
  ...) -- a longer sequence runs, on positions the model never saw in pre-training: said once,
  before training. ALiBi computed per call (Bloom, Falcon with `alibi`) and sinusoids that grow
  (XGLM) have no limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tierzero.errors import ConfigError


@dataclass(frozen=True)
class PositionLimit:
    """The longest sequence a model's positions cover: `hard` where a longer one cannot run."""

    length: int
    hard: bool
    what: str  # what holds the positions, for the message
    key: str  # the config key `length` comes from


def position_limit(
    model: nn.Module, config: Any, tokens: nn.Module, blocks: nn.Module
) -> PositionLimit | None:
    """The limit of `model` (built from `config`; `tokens` its token embedding, `blocks` its
    layers), or None where positions are computed for any length."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int):
        inside = {id(m) for m in blocks.modules()}
        if any(
            isinstance(m, nn.Embedding)
            and m is not tokens
            and id(m) not in inside
            and limit <= m.num_embeddings <= limit + 2
            for m in model.modules()
        ):
            return PositionLimit(limit, True, "learned position table", "max_position_embeddings")
        rotary = [m for m in model.modules() if "rotary" in type(m).__name__.lower()]
        # a table is 2-D, positions by features (`inv_freq`, 1-D, has a row per frequency)
        if any(
            b.ndim >= 2 and b.shape[0] == limit for m in rotary for b in m.buffers(recurse=False)
        ):
            return PositionLimit(limit, True, "rotary table", "max_position_embeddings")
        if rotary and not getattr(config, "alibi", False):  # Falcon with ALiBi builds an unused one
            return PositionLimit(limit, False, "rotary embeddings", "max_position_embeddings")
        return None
    length = getattr(config, "max_seq_len", None)  # MPT: its ALiBi bias is built this long
    if isinstance(length, int) and not isinstance(length, bool):
        return PositionLimit(length, True, "ALiBi position bias", "max_seq_len")
    return None


def check_seq_len(limit: PositionLimit | None, seq_len: int, name: str) -> str | None:
    """Refuse `seq_len` past a hard limit of the model `name`; past a rotary model's positions,
    the note to print once (None: nothing to say)."""
    if limit is None or seq_len <= limit.length:
        return None
    if limit.hard:
        raise ConfigError(
            f"--seq-len {seq_len} is longer than {name}'s {limit.what} "
            f"({limit.length} positions, {limit.key}), which a longer sequence cannot run; "
            f"use --seq-len {limit.length} or less"
        )
    return (
        f"--seq-len {seq_len} is {seq_len / limit.length:.3g}x the {limit.length} positions "
        f"{name} was built for ({limit.key}): its {limit.what} run past them, on positions it "
        f"never saw in pre-training, so it may train worse; "
        f"--seq-len {limit.length} or less stays inside"
    )
