"""The router's auxiliary loss of a Hugging Face Mixture-of-Experts model, trained through the
units.

transformers adds `router_aux_loss_coef * aux_loss` to the loss when the config says
`output_router_logits`: a load-balancing loss of every layer's router logits, which it collects
with forward hooks (`_can_record_outputs["router_logits"]`). Under the engine a block runs
under `no_grad` in the forward and is recomputed in its backward, so a logit collected by a
hook inside it would carry no gradient. Here each MoE block returns its router logits as
an output beside its hidden state (`RouterLogits.wrap`, below the engine's checkpointed entry),
so the aux loss's gradient enters the block's backward with the hidden state's; a forward
hook on the block takes them off again, so the base model's own loop sees the hidden state
alone. The head then hands the collected logits to the model's own forward
(`tierzero.hf.adapter`), which computes the aux loss and its coefficient as transformers does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class RouterLogits:
    """Each MoE block's router logits, in block order, for one forward of the model."""

    def __init__(self, base: nn.Module, blocks: nn.ModuleList) -> None:
        self.logits: list[torch.Tensor] = []
        self.attention_mask: torch.Tensor | None = None
        router_type, index = router_spec(base)
        for block in blocks:
            routers = [m for m in block.modules() if isinstance(m, router_type)]
            if routers:  # a dense layer between MoE ones (DeepSeek's first layers) has none
                block.forward = functools.partial(_with_logits, block.forward, routers, index)
                block.register_forward_hook(self._take)

    def start(self, attention_mask: torch.Tensor | None) -> None:
        """A new forward: forget the last one's logits."""
        self.logits = []
        self.attention_mask = attention_mask

    def _take(
        self, block: nn.Module, args: Any, output: tuple[Any, tuple[torch.Tensor, ...]]
    ) -> Any:
        if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], tuple)):
            return output  # the block never ran: `hf.layercalls`' recorder passed its input on
        out, logits = output
        self.logits.extend(logits)
        return out


def router_spec(base: nn.Module) -> tuple[type[nn.Module], int]:
    """The router class whose output `index` transformers records as `router_logits` in `base`."""
    from transformers.utils.output_capturing import OutputRecorder

    spec = getattr(type(base), "_can_record_outputs", None) or {}
    recorder = spec.get("router_logits")
    if isinstance(recorder, list):
        recorder = recorder[0]
    if isinstance(recorder, OutputRecorder):
        return recorder.target_class, recorder.index
    return recorder, 1  # a bare class: transformers records its output 1


def routes(base: nn.Module) -> bool:
    """Whether `base` records router logits (a Mixture-of-Experts model)."""
    spec = getattr(type(base), "_can_record_outputs", None) or {}
    return spec.get("router_logits") is not None


def _with_logits(
    forward: Callable[..., Any], routers: list[nn.Module], index: int, *args: Any, **kwargs: Any
) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """The block's own forward, and the router logits it computed, as outputs."""
    seen: list[torch.Tensor] = []

    def record(module: nn.Module, inputs: Any, output: Any) -> None:
        seen.append(output[index] if isinstance(output, tuple) else output)

    handles = [r.register_forward_hook(record) for r in routers]
    try:
        out = forward(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return out, tuple(seen)
