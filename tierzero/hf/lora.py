"""LoRA adapters (peft) on a Hugging Face model still on `meta`, initialised unit by unit.

`add_lora(hf, spec, weights)` wraps `hf.model` with peft's LoRA on `spec.targets` (the base
frozen) while every parameter is still on meta, and gives the wrapped model an `init_unit`
(`LoraInit`): the engine materialises one unit at a time (`tierzero.models.init`) and calls it,
so the unit's base tensors are read from the directory's safetensors one at a time
(`WeightFiles`; the model's own `_init_weights` when there are none) and its adapters get
peft's own init (lora_A Kaiming-uniform, lora_B zero) under a seed that depends only on
(seed, unit). The base is never whole in host memory, and `materialise_lora` (the in-memory
reference trainer's `--offload none`) starts from the same values.

Hand the engine the wrapped model and no `weights`: the adapters' names are in no file.

Without `--lora-targets` the targets are peft's default for the architecture, or, where peft
has none (DeepSeek-V2, ERNIE-4.5-MoE, Llama 4), every plain `nn.Linear` of the decoder layers
(`default_targets`): attention (MLA's low-rank projections too) and the MLP's linear layers.
Never the embedding or the head; not a subclass of `nn.Linear` whose forward computes something
else (Llama 4's router). Experts fused into one 3-D tensor per projection are not adapted: peft
adapts those only by re-parametrising the tensor on every forward, which the engine's bound
views do not support, and on transformers 5 it takes the per-expert names (DeepSeek's
`gate_proj`, `up_proj`, `down_proj`) for them even in the shared experts and dense layers, so
those names are left out and named in the note (and refused when given as `--lora-targets`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from tierzero.errors import ConfigError
from tierzero.hf.adapter import CausalLM
from tierzero.hf.build import HFModel, real_parameters
from tierzero.models.llama import unit_seed
from tierzero.models.weights import WeightFiles

# peft's name for the layer an adapter wraps (nested: one per adapted tensor)
BASE_LAYER = "base_layer"


@dataclass(frozen=True)
class LoraSpec:
    """`--lora-r/--lora-alpha/--lora-dropout/--lora-targets`: peft's `LoraConfig` fields."""

    r: int
    alpha: float
    dropout: float = 0.0
    # module names; None: peft's default for the architecture
    targets: tuple[str, ...] | None = None

    def config(self) -> object:
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.targets) if self.targets else None,
        )


def default_targets(hf: HFModel, spec: LoraSpec) -> tuple[LoraSpec, str | None]:
    """`spec` with its targets named where it names none and peft has no default for the
    architecture: every plain linear layer of the decoder layers that peft adapts as a linear
    layer, by their names; and a note saying so (None: `spec` as it was)."""
    from peft.utils.constants import (
        TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS,
    )

    model_type = hf.model.config.model_type
    if spec.targets is not None or model_type in PEFT_DEFAULTS:
        return spec, None
    inside = {
        name.rpartition(".")[2]
        for name, m in hf.model.blocks.named_modules()
        if type(m) is nn.Linear
    }
    blocks = {id(m) for m in hf.model.blocks.modules()}
    outside = {
        name.rpartition(".")[2] for name, m in hf.model.named_modules() if id(m) not in blocks
    }
    fused = _fused_expert_names(hf.model, inside)
    targets = inside - fused
    if not targets or inside & outside:
        why = (
            "it has none"
            if not targets
            else f"{sorted(inside & outside)[0]} names a module outside them"
        )
        raise ConfigError(
            f"peft has no default LoRA targets for {model_type}, and tierzero cannot take every "
            f"linear layer of its decoder layers ({why}); name them with --lora-targets"
        )
    note = (
        f"peft has no default LoRA targets for {model_type}: "
        "every linear layer of its decoder layers is adapted"
    )
    if fused:
        note += (
            f" except {', '.join(sorted(fused))} (peft takes those names for the experts' "
            "fused tensors, which tierzero cannot adapt yet)"
        )
    return replace(spec, targets=tuple(sorted(targets))), note


def _fused_expert_names(model: nn.Module, names: set[str]) -> set[str]:
    """Those of `names` that peft would adapt as a Mixture-of-Experts layer's fused expert tensors
    (its transformers-5 conversion: DeepSeek's and ERNIE's `gate_proj`, `up_proj`, `down_proj`),
    dropping them as module targets -- even in the shared experts and the dense layers."""
    from peft import LoraConfig

    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a peft without the conversion adapts linear layers by name only
        return set()
    config = LoraConfig(target_modules=sorted(names))
    convert_peft_config_for_transformers(config, model, None)
    return names - set(config.target_modules)


def add_lora(hf: HFModel, spec: LoraSpec, weights: str | Path | None) -> nn.Module:
    """`hf.model` (on meta) wrapped by peft's LoRA, with `init_unit` reading the base from
    `weights` (None: the model's own init)."""
    try:
        from peft import get_peft_model
    except ImportError:
        raise ConfigError("--lora-r needs peft; pip install 'tierzero[hf]'") from None
    try:
        model = get_peft_model(hf.model, spec.config())
    except ValueError as e:
        raise ConfigError(
            f"LoRA cannot wrap {hf.path.name} ({str(e).strip().splitlines()[0]}); name its "
            "linear layers with --lora-targets, e.g. q_proj,v_proj"
        ) from None
    tensors = model.peft_config["default"].target_parameters
    # adapted by re-parametrising the tensor on every forward, which bound views do not allow
    if tensors:
        raise ConfigError(
            f"peft adapts {', '.join(sorted(tensors))} of {hf.path.name} as the experts' fused "
            "tensors, which tierzero cannot train yet; leave their per-expert names (such as "
            "gate_proj, up_proj, down_proj) out of --lora-targets"
        )
    model.init_unit = LoraInit(hf.model, WeightFiles(weights) if weights is not None else None)
    return model


def materialise_lora(model: nn.Module, seed: int, device: torch.device | str) -> nn.Module:
    """`add_lora`'s model whole in memory, every unit initialised as the engine would."""
    init: LoraInit = model.init_unit
    real_parameters(model)
    for which in init.causal.unit_kinds():
        init(seed, which)
    return model.to(device)


class LoraInit:
    """A LoRA model's `init_unit(seed, which)`: the base from the files, then the adapters."""

    def __init__(self, causal: CausalLM, files: WeightFiles | None) -> None:
        self.causal = causal
        self.files = files

    def __call__(self, seed: int, which: int | str) -> None:
        from peft.tuners.lora import LoraLayer

        unit_id, modules = self.causal.unit_modules(which)
        adapters = [m for m in modules if isinstance(m, LoraLayer)]
        inside = {id(m) for a in adapters for m in a.modules() if m is not a.get_base_layer()}
        base = [m for m in modules if id(m) not in inside]
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(unit_seed(seed, unit_id))
            if self.files is None:
                self.causal.init_modules(base)
            else:
                self._load(base)
            for layer in adapters:
                for name in sorted({*layer.lora_A, *layer.lora_embedding_A}):
                    layer.reset_lora_parameters(name, True)

    def _load(self, modules: list[nn.Module]) -> None:
        """The modules' own parameters from the files, under the base model's names (tied
        aliases too: the files may hold either)."""
        aliases: dict[int, list[str]] = {}
        for name, p in self.causal.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(
                ".".join(part for part in name.split(".") if part != BASE_LAYER)
            )
        for module in modules:
            for p in module.parameters(recurse=False):
                if not p.is_meta:  # meta: another unit's (a tied weight the embedding unit holds)
                    p.copy_(
                        self.causal.read_weight(self.files, tuple(aliases[id(p)]), tuple(p.shape))
                    )
