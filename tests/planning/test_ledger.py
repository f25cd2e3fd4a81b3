"""The ledger, the parameter counts of the shapes and the activation estimate, counted by hand."""

from __future__ import annotations

import pytest
import torch

from tierzero.errors import ConfigError
from tierzero.layout.partition import partition
from tierzero.models import build
from tierzero.models.presets import PRESETS, ModelArgs
from tierzero.planning.ledger import (
    GB,
    Stage,
    activation_memory,
    block_numel,
    ledger,
    nearest_preset,
    nominal_numel,
    parse_count,
    scaled_units,
    units_from_args,
)

SEVEN_B = units_from_args(PRESETS["7b"])


def test_seven_b_on_eight_gpus_reproduces_the_seed_account() -> None:
    rows = ledger(nominal_numel("7b"), world_size=8, compute_itemsize=2)
    assert [r.stage for r in rows] == [Stage.DDP, Stage.STAGE1, Stage.STAGE2, Stage.STAGE3]
    assert [r.bytes_per_gpu / GB for r in rows] == [112, 38.5, 26.25, 14]


@pytest.mark.parametrize("n", [1, 2, 3, 16])
def test_stage_formulas(n: int) -> None:
    numel = 1_000_003
    got = [r.bytes_per_param for r in ledger(numel, n, compute_itemsize=2)]
    assert got == pytest.approx([16, 4 + 12 / n, 2 + 14 / n, 16 / n])
    assert [r.bytes_per_gpu for r in ledger(numel, n)] == pytest.approx([b * numel for b in got])


def test_fp32_compute_stores_four_byte_params_and_grads() -> None:
    assert [r.bytes_per_param for r in ledger(10, 2, compute_itemsize=4)] == [20, 14, 12, 10]


def test_ledger_rejects_zero_gpus() -> None:
    with pytest.raises(ConfigError, match="GPUs"):
        ledger(10, 0)


def test_nominal_and_parsed_counts() -> None:
    assert nominal_numel("7b") == 7 * 10**9
    assert nominal_numel("125m") == 125 * 10**6
    assert nominal_numel("tiny") is None
    assert parse_count("7e9") == parse_count("7B") == parse_count("7b") == 7 * 10**9
    assert parse_count("1.5M") == 1_500_000
    for bad in ("0", "-3", "seven", "7GB", ""):
        with pytest.raises(ConfigError, match="not a positive count"):
            parse_count(bad)


# --- units ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_units_add_up_to_the_exact_parameter_count(name: str) -> None:
    """Embedding, blocks, head: as the engine partitions the built model."""
    args = PRESETS[name]
    units = units_from_args(args)
    assert len(units) == args.n_layers + 2
    assert sum(n for _, n in units) == args.param_count()
    built = build(args, device="meta")
    assert units[0] == ("embedding", built.tok_emb.weight.numel())
    assert units[1][1] == sum(p.numel() for p in built.blocks[0].parameters())
    head = built.norm.weight.numel() + (0 if args.tie_embeddings else built.head.weight.numel())
    assert units[-1] == ("head", head)
    assert [name for name, _ in units] == [u.name for u in partition(built)]


def test_block_params_by_hand() -> None:
    args = ModelArgs(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=16, ffn_dim=12)
    # wq, wo: 8x8; wk, wv: 8x4; gate, up, down: 8x12; two norms: 8
    assert block_numel(args) == 2 * 64 + 2 * 32 + 3 * 96 + 16


def test_params_only_are_shaped_like_the_nearest_preset() -> None:
    assert nearest_preset(7 * 10**9) == "7b"
    assert nearest_preset(65 * 10**9) == "70b"
    units = scaled_units(7 * 10**9, PRESETS["7b"])
    assert sum(n for _, n in units) == 7 * 10**9
    assert len(units) == 34


# --- activation memory ------------------------------------------------------------------------


def test_activation_memory_by_hand() -> None:
    args = ModelArgs(
        dim=8, n_layers=3, n_heads=2, n_kv_heads=1, vocab_size=10, ffn_dim=16, max_seq_len=8
    )
    a = activation_memory(
        args, batch_size=2, seq_len=5, compute_itemsize=2, loss_chunk_bytes=4 * 10 * 3
    )
    n = 10  # tokens
    assert a.chunk_tokens == 3  # 120 bytes of fp32 logits per chunk, 10 per token
    assert a.checkpoints_bytes == (3 + 1) * n * 8 * 2
    assert a.block_forward_bytes == n * (3 * 16 + 2 * 8) * 2
    assert a.recompute_bytes == n * (7 * 8 * 2 + 4 * 8 * 4 + 4 * 16 * 2) + n * 2 * 4
    assert a.block_backward_bytes == a.recompute_bytes + n * (3 * 8 + 16) * 2
    assert a.head_backward_bytes == n * 8 * (2 * 4 + 2) + 12 * 3 * 10
    assert a.logits_bytes == 8 * 3 * 10
    assert a.total_bytes == a.checkpoints_bytes + max(
        a.block_forward_bytes, a.logits_bytes, a.block_backward_bytes, a.head_backward_bytes
    )
    assert (
        activation_memory(args, 2, 5, 2).chunk_tokens == n
    )  # no chunk size: the loss in one chunk
    with pytest.raises(ConfigError, match="max_seq_len"):
        activation_memory(args, batch_size=1, seq_len=9, compute_itemsize=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_recompute_estimate_tracks_what_autograd_saves(dtype: torch.dtype) -> None:
    """The docstring's claim: within 10% of the tensors one block saves for backward."""
    args = ModelArgs(
        dim=256, n_layers=1, n_heads=8, n_kv_heads=4, vocab_size=512, ffn_dim=768, max_seq_len=128
    )
    block = build(args, dtype=dtype).blocks[0]
    x = torch.randn(2, 128, args.dim, dtype=dtype, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    not_activations = {p.untyped_storage().data_ptr() for p in block.parameters()} | {
        x.untyped_storage().data_ptr()
    }
    saved = sum(nbytes for ptr, nbytes in storages.items() if ptr not in not_activations)
    estimated = activation_memory(args, 2, 128, dtype.itemsize).recompute_bytes
    assert saved <= estimated <= 1.1 * saved
