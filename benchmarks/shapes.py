"""The small LLaMA shape the CPU benchmarks sweep: its command-line flags and the `ModelArgs`
they make (heads of 64, SwiGLU width 8/3 dim rounded to 64, a byte vocabulary, tied head)."""

from __future__ import annotations

import argparse

from tierzero.models import ModelArgs


def add_shape_flags(
    p: argparse.ArgumentParser,
    layers: int,
    dim: int,
    batch_size: int,
    seq_len: int,
    batch_help: str | None = None,
) -> None:
    """--layers/--dim/--batch-size/--seq-len with this benchmark's defaults, and
    --steps/--rounds."""
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--dim", type=int, default=dim)
    p.add_argument("--batch-size", type=int, default=batch_size, help=batch_help)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all variants")


def shape(a: argparse.Namespace) -> ModelArgs:
    return ModelArgs(
        dim=a.dim,
        n_layers=a.layers,
        n_heads=a.dim // 64,
        n_kv_heads=a.dim // 64,
        vocab_size=256,
        ffn_dim=a.dim * 8 // 3 // 64 * 64,
        max_seq_len=a.seq_len,
        tie_embeddings=True,
    )
