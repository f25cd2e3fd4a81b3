"""`Chain`: how the vertical schedule (`tierzero.engine.vertical.schedule`) runs a model unit by
unit.

The schedule calls each unit itself, micro-batch after micro-batch, so it needs the model as a
chain: what enters the first block, each block's call, and the head's. Two kinds of model are
chains:

- the built-in LLaMA family, whose forward is exactly `head_out(blocks(tok_emb(ids)), targets)`:
  each block is a function of the hidden state alone;
- a model that runs its layers between parameter-free code of its own (a split Hugging Face
  decoder, `tierzero.hf.adapter`), offering `layer_calls(ids)`: its own forward with the layers
  recording their calls, giving the first block's hidden input and each layer's other arguments
  (position embeddings, masks, the cache off). Those are the micro-batch's *context*: computed
  once per micro-batch, with the embedding unit, and kept on the device until the step's last
  backward; each layer is then called with the hidden state that waited for it and its own
  recorded arguments, exactly as the model's forward calls it. `first_hidden(ids)` recomputes
  the embedding's part (the model's forward up to its first block) in backward.

Every call runs the unit's own forward on the weights the schedule has bound (`holding`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tierzero.engine.runtime.execute import UnitRunner
from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit
from tierzero.models.llama import Transformer


class Chain:
    """The built-in model's chain: `tok_emb(ids)`, `block(x)`, `head_out(x, targets)`."""

    def __init__(self, model: Transformer) -> None:
        self.model = model

    @property
    def dim(self) -> int:
        return self.model.args.dim

    def check(self, ids: torch.Tensor) -> None:
        if ids.shape[1] > self.model.args.max_seq_len:
            raise ConfigError(
                f"sequence length {ids.shape[1]} exceeds the model's max_seq_len "
                f"{self.model.args.max_seq_len}; use a shorter --seq-len"
            )

    def embed(self, runner: UnitRunner, unit: Unit, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The first block's input and the micro-batch's context (none here)."""
        return self.first_hidden(runner, unit, ids), None

    def first_hidden(self, runner: UnitRunner, unit: Unit, ids: torch.Tensor) -> torch.Tensor:
        return runner.compute(unit, (ids,), {}, leaves=[])

    def block(self, runner: UnitRunner, unit: Unit, x: torch.Tensor, context: Any) -> torch.Tensor:
        return runner.compute(unit, (x,), {}, leaves=[])

    def head(
        self,
        runner: UnitRunner,
        unit: Unit,
        x: torch.Tensor,
        targets: torch.Tensor,
        divisor: float | None = None,
    ) -> torch.Tensor:
        """The loss; `divisor`, the step's `num_items_in_batch`
        (`engine.reference.loss_divisor`)."""
        kwargs = {} if divisor is None else {"num_items_in_batch": divisor}
        return runner.compute(unit, (x, targets), kwargs, leaves=[])


class LayerChain(Chain):
    """A model whose own forward calls its layers with arguments beyond the hidden state
    (`layer_calls`, `first_hidden`: see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def check(self, ids: torch.Tensor) -> None:
        pass  # the model's loader checks --seq-len against its positions

    def embed(self, runner: UnitRunner, unit: Unit, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        with runner.holding(unit):
            return self.model.layer_calls(ids)

    def first_hidden(self, runner: UnitRunner, unit: Unit, ids: torch.Tensor) -> torch.Tensor:
        with runner.holding(unit):
            return self.model.first_hidden(ids)

    def block(self, runner: UnitRunner, unit: Unit, x: torch.Tensor, context: Any) -> torch.Tensor:
        args, kwargs = context[unit.index - 1].with_hidden(x)
        out = runner.compute(unit, args, kwargs, leaves=[])
        return out[0] if isinstance(out, tuple) else out


def chain_of(model: nn.Module, units: list[Unit]) -> Chain | str:
    """`model` as a chain of `units`, or why the vertical schedule cannot drive it."""
    if units[0].kind != "embedding" or units[-1].kind != "head":
        return "its units are not an embedding, blocks and a head"
    if isinstance(model, Transformer) and type(model).forward is Transformer.forward:
        return Chain(model)
    owner = next(
        (m for m in model.modules() if callable(getattr(type(m), "layer_calls", None))), None
    )
    if owner is not None:
        return owner.layer_calls_refusal() or LayerChain(owner)
    return (
        f"{type(model).__name__} is neither the built-in model nor a decoder whose layer calls the "
        "engine can record"
    )
