"""Hugging Face causal LMs from local directories (the optional `tierzero[hf]` extra).

`load_model("hf:<dir>")` builds the model of a directory's `config.json` with its parameters
on `meta`, wrapped in tierzero's model contract (`adapter`); hand it to `Engine` with
`weights=<dir>` to stream the directory's safetensors into the tiers unit by unit. Checkpoints
record `describe(hf, model)`, which names a peft model's adapter config for export.
"""

from tierzero.hf.adapter import CausalLM, SplitCausalLM
from tierzero.hf.build import HFModel, describe, is_hf, load_model, materialise, model_dir

__all__ = [
    "CausalLM",
    "HFModel",
    "describe",
    "SplitCausalLM",
    "is_hf",
    "load_model",
    "materialise",
    "model_dir",
]
