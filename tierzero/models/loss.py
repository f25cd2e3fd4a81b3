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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def chunk_tokens_for(vocab_size: int, chunk_bytes: int) -> int:
    """Tokens per chunk so one chunk's fp32 logits take about `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab_size))


def trained_targets(targets: torch.Tensor) -> int:
    """How many of `targets` are trained (not -100): what a step's loss is divided by."""
    return int((targets != IGNORE_INDEX).sum())


def chunked_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                          targets: torch.Tensor, chunk_tokens: int,
                          num_items_in_batch: float | torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of `head(hidden)` against `targets` (ignoring -100) in fp32, summed and
    divided by `num_items_in_batch` (default: the trained targets' count, i.e. their mean)."""
    h, t = hidden.flatten(0, -2), targets.flatten()
    if t.numel() <= chunk_tokens:
        if num_items_in_batch is None:
            return F.cross_entropy(head(h).float(), t, ignore_index=IGNORE_INDEX)
        return _chunk_loss_sum(head, h, t) / num_items_in_batch
    total = None
    for start in range(0, t.numel(), chunk_tokens):
        part = checkpoint(_chunk_loss_sum, head, h[start:start + chunk_tokens], t[start:start + chunk_tokens],
                          use_reentrant=False)
        total = part if total is None else total + part
    return total / (num_items_in_batch if num_items_in_batch is not None else (t != IGNORE_INDEX).sum().clamp(min=1))


def _chunk_loss_sum(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")
