"""The loss without full logits: cross-entropy over the sequence in chunks of tokens.

The (tokens x vocab) fp32 logits of a big-vocabulary model are the largest tensor of a step
(LLaMA-3's 128k vocabulary: 0.5 GB per 1k tokens). Here the head runs on `chunk_tokens` tokens
at a time, each chunk under activation checkpointing (only its hidden slice is kept; backward
recomputes its logits), so at most one chunk's logits exist at once, forward or backward.

Exactness: each chunk's loss is a sum in fp32; the chunks' sums are added in order and divided
by the token count. A single chunk (the default for small vocabularies) is bitwise the plain
`F.cross_entropy(logits.float(), targets)`; several chunks differ from it only by summation
order (relative error ~1e-7 in fp32, measured in tests/models/test_models.py).

The divisor. By default a micro-batch's loss is the mean over its own trained targets (those
not -100). A step of several micro-batches or ranks whose trained targets differ in number
must instead divide every token's loss by one count, so that the step's loss is the sum over
all its trained tokens divided by their number: `num_items_in_batch` (Hugging Face's name for
it) replaces the micro-batch's own count. The sum divided by a count equal to the micro-batch's
own is bitwise its mean (forward and backward; tests/models/test_models.py).

Calling a model for its loss (`compute_loss`) and the divisor of a micro-batch
(`loss_divisor`) live here too: training, evaluation and the reference trainer (the tests'
oracle) share one definition of the loss.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierzero.errors import ConfigError

IGNORE_INDEX = -100


def chunk_tokens_for(vocab_size: int, chunk_bytes: int) -> int:
    """Tokens per chunk so one chunk's fp32 logits take about `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab_size))


def trained_targets(targets: torch.Tensor) -> int:
    """How many of `targets` are trained (not -100): what a step's loss is divided by."""
    return int((targets != IGNORE_INDEX).sum())


def chunked_cross_entropy(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of `head(hidden)` against `targets` (ignoring -100) in fp32, summed and
    divided by `num_items_in_batch` (default: the trained targets' count, i.e. their mean)."""
    h, t = hidden.flatten(0, -2), targets.flatten()
    if t.numel() <= chunk_tokens:
        if num_items_in_batch is None:
            return F.cross_entropy(head(h).float(), t, ignore_index=IGNORE_INDEX)
        return _chunk_loss_sum(head, h, t) / num_items_in_batch
    total = None
    for start in range(0, t.numel(), chunk_tokens):
        part = checkpoint(
            _chunk_loss_sum,
            head,
            h[start : start + chunk_tokens],
            t[start : start + chunk_tokens],
            use_reentrant=False,
        )
        total = part if total is None else total + part
    return total / (
        num_items_in_batch
        if num_items_in_batch is not None
        else (t != IGNORE_INDEX).sum().clamp(min=1)
    )


def _chunk_loss_sum(
    head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")


def compute_loss(
    model: nn.Module, batch: Any, num_items_in_batch: float | None = None
) -> torch.Tensor:
    """A dict batch is `model(**batch)`, a tuple `model(*batch)`; the loss is the output or `.loss`.
    `num_items_in_batch`, when given, is passed on: the model divides its tokens' summed loss by
    it instead of by their own count (`tierzero.models.loss`)."""
    kwargs = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    if kwargs and not _takes_num_items(model):
        raise ConfigError(
            f"{type(model).__name__}.forward takes no num_items_in_batch, so its loss cannot be "
            "divided by the step's trained tokens; add that keyword (divide the summed token loss "
            "by it) or leave step_tokens out"
        )
    if isinstance(batch, dict):
        out = model(**batch, **kwargs)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch, **kwargs)
    else:
        out = model(batch, **kwargs)
    return out if isinstance(out, torch.Tensor) else out.loss


def _takes_num_items(model: nn.Module) -> bool:
    params = inspect.signature(model.forward).parameters.values()
    return any(p.name == "num_items_in_batch" or p.kind is p.VAR_KEYWORD for p in params)


def loss_divisor(
    step_tokens: int | None, summed: bool, accumulate: int, world_size: int
) -> float | None:
    """What a micro-batch's summed token loss is divided by (None: its own trained tokens' count,
    its mean). `step_tokens`: the number of trained tokens (targets not -100) in the step's whole
    batch -- every micro-batch, every rank -- counted before its first backward. The divisor is
    then `step_tokens / (accumulate * world_size)`, so that backward's averaging over the step's
    micro-batches and the ranks' reduction (a mean) leave the sum over every trained token of the
    step divided by their number, however unevenly they fall; the mean of the micro-batches'
    losses is that step's loss. Equal micro-batches of unmasked data get their own count: bitwise
    the plain mean. `summed`: 1, the sum itself (an evaluation divides by its own total)."""
    if summed:
        return 1.0
    if step_tokens is None:
        return None
    if (
        isinstance(step_tokens, bool)
        or not isinstance(step_tokens, numbers.Integral)
        or step_tokens < 0
    ):
        raise ConfigError(
            f"step_tokens must be the step's number of trained tokens (an integer >= 0), "
            f"got {step_tokens!r}"
        )
    return max(int(step_tokens), 1) / (accumulate * world_size)
