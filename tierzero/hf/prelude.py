"""The prelude: the embedding unit of a model that runs modules of its own before the blocks.

GPT-2 adds a learned position table (`wpe`) to the token embeddings, OPT an offset one
(`embed_positions`), inside the base model's forward, outside any module tierzero can wrap
alone. `Prelude` is one entry point for both: `forward(input_ids, attention_mask)` runs the
base model's own forward for real up to the first block and returns the hidden state that
block would get (`stop_at`: a pre-hook on block 0 that raises it back). The engine wraps it
like any unit's entry, so the token and position tables are one unit, bound only while it
runs (and recomputed in backward).

The rest of the pass runs the base forward again (`replaying`): its parameter-free parts
(positions, masks, rotary tables) are recomputed, while the prelude's modules read zero weights
(expanded, no memory) and its dropouts pass their input through, until block 0 is called; a
pre-hook there restores them and hands the block the prelude's hidden state instead. So the
blocks see exactly what the model's own forward gives them, and no random number is drawn
twice.

The `Prelude` module holds the model's modules as its children (so a partition sees them as
one unit) but is never registered in the model: parameter names stay the checkpoint's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


class Prelude(nn.Module):
    """The token embedding and the other modules that run before the blocks, as one unit."""

    def __init__(
        self, tokens: nn.Module, others: list[nn.Module], run: Callable[..., torch.Tensor]
    ) -> None:
        super().__init__()
        self.tokens = tokens
        self.others = nn.ModuleList(others)
        object.__setattr__(self, "run", run)  # the adapter's base forward up to block 0

    def parts(self) -> list[nn.Module]:
        """The model's own modules of this unit (not this wrapper or its list)."""
        return [*self.tokens.modules(), *(m for o in self.others for m in o.modules())]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is None:
            return self.run(input_ids, attention_mask)
        return self.run(input_ids, attention_mask, position_ids)  # generation: after cached tokens


class _Reached(Exception):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def _hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@contextlib.contextmanager
def stop_at(block: nn.Module) -> Iterator[Callable[[Callable[[], Any]], torch.Tensor]]:
    """Yields `until_block(call)`: runs `call` until `block` is called, and returns its hidden
    input."""

    def raise_hidden(module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Reached(_hidden_arg(args, kwargs))

    def until_block(call: Callable[[], Any]) -> torch.Tensor:
        try:
            call()
        except _Reached as reached:
            return reached.hidden
        raise AssertionError("the base model's forward never called its first block")

    handle = block.register_forward_pre_hook(raise_hidden, with_kwargs=True)
    try:
        yield until_block
    finally:
        handle.remove()


@contextlib.contextmanager
def replaying(
    block: nn.Module, hidden: torch.Tensor, prelude: Prelude, dropouts: list[nn.Module]
) -> Iterator[None]:
    """Inside, the base forward's prelude modules compute on zero weights and its dropouts are
    the identity until `block` is called, which then gets `hidden` as its hidden input."""
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for module in prelude.parts():
        # a weight is an nn.Parameter, or a plain attribute once the engine owns it
        held = [(module._parameters, k) for k, p in module._parameters.items() if p is not None]
        held += [(vars(module), k) for k, t in vars(module).items() if isinstance(t, torch.Tensor)]
        for where, name in held:
            weight = where[name]
            saved.append((where, name, weight))
            where[name] = torch.zeros((), dtype=weight.dtype, device=hidden.device).expand(
                weight.shape
            )
    for module in dropouts:
        module.forward = _identity

    def restore() -> None:
        for where, name, weight in saved:
            where[name] = weight
        saved.clear()
        for module in dropouts:
            vars(module).pop("forward", None)

    def substitute(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        restore()
        handle.remove()
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    handle = block.register_forward_pre_hook(substitute, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        restore()


def _identity(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x
