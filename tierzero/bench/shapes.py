"""The shape the NVMe-traffic benchmarks measure, one definition for all of them.

A 134.1M LLaMA shape (dim 768, 12 layers, vocab 32000, untied) whose state, everything on NVMe,
is far beyond a 512 MiB host budget, so the bytes a step moves are the drive's; `quick` is a
small stand-in (4 layers, dim 256, vocab 4096) under 256 MiB that runs the same code in seconds.
"""

from __future__ import annotations

import dataclasses

from tierzero.models import ModelArgs

NVME_SHAPE = ModelArgs(
    dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000, ffn_dim=2048
)
QUICK_SHAPE = dataclasses.replace(
    NVME_SHAPE, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=4096
)


# the same 134.1M shape as a Hugging Face LlamaConfig's keys, and a quick stand-in
HF_SHAPE = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
HF_QUICK = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 4096,
    "max_position_embeddings": 256,
}


def nvme_shape(quick: bool, host_budget: str) -> tuple[ModelArgs, str]:
    """The model and host budget to measure: the 134.1M shape at `host_budget`, or the quick one
    at 256 MiB."""
    return (QUICK_SHAPE, "256MiB") if quick else (NVME_SHAPE, host_budget)
