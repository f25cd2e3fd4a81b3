"""The model a run trains: a built-in preset, or a Hugging Face directory (`hf:<dir>`).

Either way the run gets the same few things: the model on `meta` (for the engine, which
materialises it unit by unit), or in memory (for the reference trainer), the vocabulary its
data must fit, the weights to start from, the tokenizer for text data, and the description a
checkpoint records (for a Hugging Face model its `config.json`, which export writes back).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tierzero import models
from tierzero.config import RunConfig
from tierzero.errors import ConfigError
from tierzero.run.corpus import TOKEN_SUFFIXES, TextTokenizer

if TYPE_CHECKING:
    from tierzero.hf import HFModel


@dataclass
class RunModel:
    name: str
    vocab_size: int
    n_params: int
    weights: str | None  # local safetensors to start from; None: initialise from the seed
    tokenizer: TextTokenizer | None  # None: text is read as bytes
    description: dict[str, Any]  # what checkpoints record about the model
    notes: list[str] = field(default_factory=list)
    hf_model: HFModel | None = None  # for hf:<dir>
    # hf_model's model under LoRA adapters (tierzero.hf.lora), on meta
    lora_model: nn.Module | None = None

    @property
    def engine_weights(self) -> str | None:
        """The files the engine reads by parameter name; None under LoRA, whose model reads its
        base itself unit by unit (`tierzero.hf.lora`): the adapters are in no file."""
        return None if self.lora_model is not None else self.weights

    def on_meta(self) -> nn.Module:
        if self.lora_model is not None:
            return self.lora_model
        if self.hf_model is not None:
            return self.hf_model.model
        return models.build(self.name, device="meta")

    def in_memory(self, device: torch.device, seed: int) -> nn.Module:
        """Every parameter on `device`: from `weights`, or initialised as the engine would."""
        if self.lora_model is not None:
            from tierzero.hf.lora import materialise_lora

            return materialise_lora(self.lora_model, seed, device)
        if self.hf_model is not None:
            from tierzero.hf import materialise

            return materialise(self.hf_model, seed, device, self.weights)
        model = models.build(self.name, device=device, seed=seed)
        if self.weights:
            from tierzero.models.weights import WeightFiles

            files = WeightFiles(self.weights)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(files.load((name,), tuple(param.shape)))
        return model


def run_model(run: RunConfig) -> RunModel:
    """Resolve `run.model`: check the preset or the directory, build nothing heavy."""
    from tierzero.hf import is_hf

    if not is_hf(run.model):
        if run.lora.lora_r is not None:
            raise ConfigError(
                f"--lora-r adapts a Hugging Face model; pass --model hf:DIR, not the preset "
                f"'{run.model}' (or drop --lora-r to train it whole)"
            )
        args = models.get_preset(run.model)
        return RunModel(
            run.model, args.vocab_size, args.param_count(), run.weights, None, {"preset": run.model}
        )
    from tierzero.hf import load_model

    hf = load_model(run.model, run.engine.streaming.units)
    past_positions = hf.check_seq_len(run.seq_len)
    weights = run.weights or (str(hf.weights) if hf.weights is not None else None)
    tokenizer, notes = None, [past_positions] if past_positions else []
    if weights is None:
        notes.append(
            f"model directory {hf.path} has no *.safetensors: every unit is initialised by the "
            f"model's own _init_weights from seed {run.engine.seed}"
        )
    if hf.tokenizer is not None:
        tokenizer = TextTokenizer(hf.tokenizer, _eos_id(hf.config))
    elif not (run.corpus.data and Path(run.corpus.data).suffix in TOKEN_SUFFIXES):
        notes.append(
            f"model directory {hf.path} has no tokenizer.json: text is read as bytes (ids 0-255), "
            "which this model was not trained on; copy the model's tokenizer.json there"
        )
    if run.lora.lora_r is None:
        return RunModel(
            f"hf:{hf.path}",
            hf.vocab_size,
            hf.param_count(),
            weights,
            tokenizer,
            hf.description(),
            notes,
            hf,
        )
    from tierzero.hf import describe
    from tierzero.hf.lora import LoraSpec, add_lora, default_targets

    spec, targets_note = default_targets(
        hf,
        LoraSpec(
            run.lora.lora_r,
            run.lora.lora_alpha,
            run.lora.lora_dropout,
            tuple(run.lora.lora_targets) if run.lora.lora_targets else None,
        ),
    )
    notes += [targets_note] if targets_note else []
    model = add_lora(hf, spec, weights)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    targets = ", ".join(sorted(model.peft_config["default"].target_modules))
    notes.append(
        f"LoRA r={spec.r} alpha={spec.alpha:g} on {targets}: "
        f"{trained:,} trainable parameters, the base's {hf.param_count() - trained:,} frozen"
    )
    return RunModel(
        f"hf:{hf.path}",
        hf.vocab_size,
        hf.param_count(),
        weights,
        tokenizer,
        describe(hf, model),
        notes,
        hf,
        model,
    )


def _eos_id(config: dict[str, Any]) -> int | None:
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None
