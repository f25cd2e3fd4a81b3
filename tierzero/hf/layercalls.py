"""`LayerCall`: one decoder layer's call as the model's own forward makes it, recorded so that
the vertical schedule (`tierzero.engine.vertical.chain`) can make it again, layer by layer.

A Hugging Face decoder computes, between its embedding and its first layer, what its layers
take beside the hidden state: rotary position embeddings, the causal (or sliding-window) mask,
position ids, the cache (off). `recording` runs the base model's forward with each layer
replaced by a recorder that keeps its arguments and passes the hidden state through, so one
parameter-free pass per micro-batch gives every layer's call; the vertical schedule then calls
each layer on the hidden state that waited for it, with the arguments recorded for it (models
that alternate attention kinds get each layer's own mask).

That is only the model's forward if the forward hands each layer's output to the next layer
and the last one's to the final norm unchanged; `check_chain` refuses a model that does not.
Layers of older families return a tuple whose first element is the hidden state (MPT's): the
recorders then return `(hidden,)` (`as_tuple`), which such a forward unpacks the same way.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tierzero.errors import ConfigError


@dataclass
class LayerCall:
    """A layer's arguments: the hidden state (positional or `hidden_states=`) and the rest."""

    hidden: torch.Tensor
    args: tuple
    kwargs: dict[str, Any]
    positional: bool

    def with_hidden(self, x: torch.Tensor) -> tuple[tuple, dict[str, Any]]:
        """The call's arguments with `x` as its hidden state."""
        if self.positional:
            return (x, *self.args), self.kwargs
        return self.args, {**self.kwargs, "hidden_states": x}


@contextlib.contextmanager
def recording(layers: nn.ModuleList, as_tuple: bool = False) -> Iterator[list[LayerCall]]:
    """Inside, each layer of `layers` records its call (appended to the yielded list) and
    returns its hidden input (in a 1-tuple `as_tuple`); their forwards (the engine's entries
    among them) come back after."""
    calls: list[LayerCall] = []
    saved = [vars(layer).get("forward") for layer in layers]
    for layer in layers:
        layer.forward = functools.partial(_record, calls, as_tuple)
    try:
        yield calls
    finally:
        for layer, forward in zip(layers, saved):
            if forward is None:
                vars(layer).pop("forward", None)
            else:
                layer.forward = forward


def _record(calls: list[LayerCall], as_tuple: bool, *args: Any, **kwargs: Any) -> Any:
    if args:
        calls.append(LayerCall(args[0], args[1:], kwargs, True))
    else:
        kwargs = dict(kwargs)
        calls.append(LayerCall(kwargs.pop("hidden_states"), (), kwargs, False))
    return (calls[-1].hidden,) if as_tuple else calls[-1].hidden


def chained(calls: list[LayerCall], layers: int, last_hidden: Any) -> bool:
    """Whether the forward called its layers once each in a chain, ending at `last_hidden`."""
    first = calls[0].hidden if calls else None
    return (
        len(calls) == layers
        and all(_same(c.hidden, first) for c in calls)
        and _same(last_hidden, first)
    )


def refuse_unchained(model: str) -> None:
    raise ConfigError(
        f"{model}'s forward changes the hidden state between its layers, so the vertical "
        "schedule cannot call them one by one; use --schedule horizontal"
    )


def _same(a: Any, b: Any) -> bool:
    """The same values: one tensor, or a view of it with its shape and strides."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and (
            a is b
            or (
                a.data_ptr() == b.data_ptr()
                and a.shape == b.shape
                and a.stride() == b.stride()
                and a.dtype == b.dtype
            )
        )
    )
