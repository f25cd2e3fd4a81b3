"""The LoRA (peft) view of an export: which tensors a peft adapter holds and under what names,
or the base model's tensors with the adapters merged in.

A peft model's parameters are named `base_model.model.<base name>` with `.base_layer.` before a
wrapped layer's own weight and `lora_A.<adapter>.weight` / `lora_B.<adapter>.weight` beside it.
Written as they are, `from_pretrained` finds none of its names and loads a random model; so an
export of a LoRA run is either a peft adapter (`adapter_model.safetensors` under peft's names:
the adapter's name dropped, as `get_peft_model_state_dict` does, plus `adapter_config.json`) or,
with `--merge`, the base model's own names with `W + scaling * (B @ A)` for each wrapped weight,
computed unit by unit as the writer streams (a layer's adapters live in its unit). The peft
config comes from the checkpoint's model description (`tierzero.hf.describe`): alpha cannot be
read off the shapes. This module does no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from tierzero.errors import CheckpointError, ConfigError

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class Merge:
    """`W + scale * (B @ A)` (transposed first for fan-in-fan-out layers such as GPT-2's Conv1D)."""

    a: Any  # the TensorEntry of lora_A
    b: Any  # the TensorEntry of lora_B
    scale: float
    transpose: bool

    def apply(self, weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        a = flat[self.a.offset : self.a.offset + self.a.numel].view(self.a.shape)
        b = flat[self.b.offset : self.b.offset + self.b.numel].view(self.b.shape)
        delta = b @ a  # as peft's get_delta_weight: product, transpose, then scale
        return weight + (delta.T if self.transpose else delta) * self.scale


def peft_adapters(
    model: dict[str, Any] | None, names: list[str]
) -> dict[str, dict[str, Any]] | None:
    """The checkpoint's peft configs by adapter name; None for a model without adapters. A
    checkpoint with LoRA tensors but no recorded config is refused (its export would not load)."""
    adapters = (model or {}).get("peft")
    if isinstance(adapters, dict) and adapters:
        if len(adapters) > 1:
            raise ConfigError(
                f"the checkpoint's model has {len(adapters)} peft adapters "
                f"({', '.join(adapters)}); export handles one: train with a single adapter"
            )
        return adapters
    lora = next((n for n in names if ".lora_A." in n or ".lora_B." in n), None)
    if lora is not None:
        raise CheckpointError(
            f"the checkpoint holds LoRA tensors ({lora}) but not their peft config, so no "
            "export of it would load; save checkpoints with model=tierzero.hf.describe(hf, "
            "peft_model)"
        )
    return None


def adapter_entries(entries: list[Any], adapter: str) -> list[Any]:
    """The adapter's tensors under the names `PeftModel.from_pretrained` reads."""
    tag = f".{adapter}."
    return [
        replace(e, name=e.name.replace(tag, "."))
        for e in entries
        if tag in e.name and ".lora_" in e.name
    ]


def merged_entries(entries: list[Any], adapter: str, config: dict[str, Any]) -> list[Any]:
    """The base model's tensors under its own names, each wrapped weight with its adapter merged."""
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    transpose = bool(config.get("fan_in_fan_out"))
    by_name = {e.name: e for e in entries}
    out = []
    for e in entries:
        if ".lora_" in e.name:
            continue
        name = e.name[len(PEFT_PREFIX) :] if e.name.startswith(PEFT_PREFIX) else e.name
        name = name.replace(".base_layer.", ".")
        merge = None
        if ".base_layer.weight" in e.name:
            layer = e.name[: -len(".base_layer.weight")]
            a, b = (
                by_name.get(f"{layer}.lora_A.{adapter}.weight"),
                by_name.get(f"{layer}.lora_B.{adapter}.weight"),
            )
            if a is not None and b is not None:
                if not a.unit == b.unit == e.unit:
                    raise CheckpointError(
                        f"{layer}'s LoRA tensors sit in other units than its weight; "
                        "export the adapter without --merge and merge it with peft"
                    )
                merge = Merge(a, b, scale, transpose)
        out.append(replace(e, name=name, merge=merge))
    return out


def adapter_config(config: dict[str, Any], base: str | None) -> dict[str, Any]:
    """`adapter_config.json` as peft's `save_pretrained` writes it, for inference."""
    doc = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.items()}
    return {
        **doc,
        "base_model_name_or_path": base or doc.get("base_model_name_or_path"),
        "inference_mode": True,
    }
