"""Init that never materialises the model: one unit at a time, into flat fp32 buffers.

A unit's parameters are created on the CPU (if the model is on `meta`), initialised — by the
model's own `init_unit(seed, block)` when it has one (the built-in model does, so the result
equals `models.build(seed=...)` bitwise), else by each module's `reset_parameters()` under a
per-unit seed — or loaded from local `.safetensors` files; then flattened. Peak host memory is
about one unit, not the model.
"""

from __future__ import annotations

import torch
from torch import nn

from tierzero.layout.partition import Unit
from tierzero.models.weights import WeightFiles, weight_files

__all__ = ["WeightFiles", "flat_unit", "weight_files"]


def flat_unit(model: nn.Module, unit: Unit, seed: int, weights: WeightFiles | None) -> torch.Tensor:
    """The unit's parameters as one padded fp32 CPU buffer (materialising them if needed)."""
    flat = torch.zeros(unit.padded_numel, dtype=torch.float32)
    on_meta = any(getattr(m, a).is_meta for s in unit.slots for m, a in s.module_attrs)
    if weights is not None:
        # a Hugging Face model's: its files' layout may differ
        read = getattr(model, "read_weight", None)
        for slot in unit.slots:
            value = (
                read(weights, slot.names, slot.shape)
                if callable(read)
                else weights.load(slot.names, slot.shape)
            )
            flat[slot.offset : slot.end] = value.reshape(-1)
        return flat
    if on_meta:
        _materialise(unit)
        _initialise(model, unit, seed)
    for slot in unit.slots:
        module, attr = slot.module_attrs[0]
        flat[slot.offset : slot.end] = getattr(module, attr).detach().reshape(-1).float().cpu()
    return flat


def _materialise(unit: Unit) -> None:
    for slot in unit.slots:
        param = nn.Parameter(torch.empty(slot.shape, dtype=torch.float32))
        for module, attr in slot.module_attrs:
            module._parameters[attr] = param


def _initialise(model: nn.Module, unit: Unit, seed: int) -> None:
    init_unit = getattr(model, "init_unit", None)
    if callable(init_unit):
        init_unit(seed, unit.index - 1 if unit.kind == "block" else unit.kind)
        return
    modules = {id(m): m for s in unit.slots for m, _ in s.module_attrs}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 100003 + unit.index)
        for module in modules.values():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
