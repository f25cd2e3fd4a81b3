"""Generation's cache for a Hugging Face model: transformers' own `DynamicCache`, and each pass's
attention mask and position ids made as `generate` makes them.

The cache object is handed through the model's forward to every layer (the units' entries pass
their keyword arguments on), and each layer appends its keys and values to it on the compute
device: the cache lives beside the activations, outside the tiers' pools. Rows are
left-padded to one length; as in `generate`, a row's position ids count its tokens from its
first one (`cumsum` of the mask, minus one; a pad's is 0) and the 2-D mask covers every
position so far, or is left out when no row is padded.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from tierzero.errors import ConfigError
from tierzero.hf.positions import PositionLimit


class HFCache:
    """A `DynamicCache` and the positions it holds, for rows left-padded by `pad`."""

    def __init__(self, config: Any, pad: list[int], capacity: int) -> None:
        from transformers import DynamicCache

        self.dynamic = DynamicCache(config=config)
        self.pad = pad
        self.capacity = capacity
        self.length = 0  # positions held once the pass under way has appended its own

    def inputs(self, ids: torch.Tensor) -> dict[str, Any]:
        """The adapter's keyword arguments for a pass over `ids` (B, T), the tokens that follow."""
        return {"input_ids": ids, "cache": self}

    @property
    def nbytes(self) -> int:
        """The keys' and values' bytes the cache holds now (its layers' `keys` and `values`)."""
        layers = getattr(self.dynamic, "layers", [])
        held = [getattr(layer, name, None) for layer in layers for name in ("keys", "values")]
        return sum(t.nbytes for t in held if isinstance(t, torch.Tensor))

    def advance(self, T: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Begin a pass of `T` positions: the attention mask (None: no row is padded) and their
        position ids (B, T)."""
        if self.length + T > self.capacity:
            raise ValueError(
                f"a decode cache for {self.capacity} positions was asked for {self.length + T}"
            )
        start, self.length = self.length, self.length + T
        if not any(self.pad):
            return None, torch.arange(start, self.length, device=device)[None]
        pad = torch.tensor(self.pad, dtype=torch.long, device=device)[:, None]
        mask = (torch.arange(self.length, device=device)[None] >= pad).long()
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        return mask, positions[:, start:]

    def keywords(
        self, base: nn.Module, mask: torch.Tensor | None, positions: torch.Tensor
    ) -> dict[str, Any]:
        """What the base model's forward takes for a cached pass (its cache keyword is `cache`
        in transformers 5, `past_key_values` before)."""
        name = (
            "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        )
        return {
            name: self.dynamic,
            "use_cache": True,
            "attention_mask": mask,
            "position_ids": positions,
        }


def check_positions(limit: PositionLimit | None, capacity: int, model: str) -> None:
    """Refuse a generation longer than the positions a model can run (`tierzero.hf.positions`)."""
    if limit is not None and limit.hard and capacity > limit.length:
        raise ConfigError(
            f"the longest prompt and its new tokens make {capacity} positions, past the "
            f"{limit.length} of {model}'s {limit.what} ({limit.key}); use a shorter prompt or "
            "fewer new tokens"
        )
