"""The built-in model: preset sizes against the public numbers, meta builds, init determinism,
and the forward pass's contract (shapes, loss at init, causality, dtypes)."""

import math

import pytest
import torch

from tierzero.errors import ConfigError
from tierzero.models import PRESETS, ModelArgs, build, get_preset
from tierzero.models.loss import chunk_tokens_for
from tierzero.planning.ledger import activation_memory

# The public parameter count each preset is compared with, and where it comes from.
PUBLIC_PARAMS = {
    "125m": 125e6,  # GPT-3 Small's size name (MobileLLM-125M's shape: 124.6M)
    "350m": 350e6,  # GPT-3 Medium's size name (MobileLLM-350M's shape: 345.3M)
    "1b": 1.24e9,  # LLaMA-3.2-1B model card: 1.23B (1,235,814,400)
    "3b": 3.21e9,  # LLaMA-3.2-3B model card: 3.21B (3,212,749,824)
    "7b": 6.74e9,  # LLaMA-2-7B: 6.74B (6,738,415,616)
    "13b": 13.0e9,  # LLaMA-2-13B: 13.0B (13,015,864,320)
    "70b": 69.0e9,  # LLaMA-2-70B: 68.98B (68,976,648,192), published as "70B"
}


def unique_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("name", PUBLIC_PARAMS)
def test_preset_param_count_within_2_percent_of_public_size(name: str) -> None:
    assert abs(PRESETS[name].param_count() / PUBLIC_PARAMS[name] - 1) < 0.02


def test_70b_is_also_within_2_percent_of_its_name() -> None:
    assert abs(PRESETS["70b"].param_count() / 70e9 - 1) < 0.02


@pytest.mark.parametrize("name", PRESETS)
def test_param_count_equals_meta_model(name: str) -> None:
    model = build(name, device="meta", dtype=torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert unique_numel(model) == PRESETS[name].param_count()


def test_tiny_is_a_few_million_byte_level_params() -> None:
    args = PRESETS["tiny"]
    assert args.vocab_size == 256 and args.tie_embeddings
    assert 1e6 < args.param_count() < 10e6


def test_model_has_no_buffers() -> None:
    assert list(build("tiny", device="meta").buffers()) == []


def test_unknown_preset_names_the_choices() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown model preset 'huge'; choose one of: tiny, 125m, .*70b"
    ):
        get_preset("huge")


@pytest.mark.parametrize(
    "bad", [dict(n_heads=3), dict(n_kv_heads=3), dict(dim=0), dict(dim=24, n_heads=8)]
)
def test_bad_shapes_are_config_errors(bad: dict) -> None:
    shape = dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=16, ffn_dim=64) | bad
    with pytest.raises(ConfigError):
        ModelArgs(**shape)


def test_forward_backward_shapes_and_loss_at_init() -> None:
    model = build("tiny")
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    assert model(x).shape == (2, 32, 256)
    loss = model(x, y)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    # near-uniform at init; a little above ln(256) because logits have std 0.02*sqrt(dim) = 0.32
    # and the tied head favours the input token, which random targets rarely are
    assert loss.item() == pytest.approx(math.log(256), abs=0.2)
    loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_tied_embeddings_share_storage() -> None:
    model = build("tiny")
    assert model.head.weight is model.tok_emb.weight
    assert model.head.weight.data_ptr() == model.tok_emb.weight.data_ptr()


def test_untied_head_is_separate() -> None:
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=16, ffn_dim=64)
    model = build(args)
    assert model.head.weight.data_ptr() != model.tok_emb.weight.data_ptr()
    assert unique_numel(model) == args.param_count()


def test_same_seed_same_weights_different_seed_differs() -> None:
    a, b, c = build("tiny", seed=7), build("tiny", seed=7), build("tiny", seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):  # norms start at ones whatever the seed
            assert not torch.equal(pa, pc), name


def test_init_statistics() -> None:
    model = build("tiny")
    assert model.blocks[0].attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(256))
    assert not torch.equal(
        model.blocks[0].attn.wq.weight, model.blocks[1].attn.wq.weight
    )  # own streams


def test_unit_by_unit_init_from_meta_equals_build() -> None:
    """What the engine does: materialise a meta model one unit at a time, in any order."""
    built = build("tiny", seed=3)
    model = build("tiny", device="meta")
    model.to_empty(device="cpu")
    model.tie_weights()
    for block in reversed(range(len(model.blocks))):
        model.init_unit(3, block)
    model.init_unit(3, "root")
    for (name, p), q in zip(built.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_bf16_build_is_the_rounding_of_fp32_and_runs() -> None:
    fp32, bf16 = build("tiny"), build("tiny", dtype=torch.bfloat16)
    assert torch.equal(fp32.blocks[1].mlp.w_up.weight.bfloat16(), bf16.blocks[1].mlp.w_up.weight)
    x = torch.randint(0, 256, (2, 16))
    assert bf16(x).dtype == torch.bfloat16
    loss = bf16(x, x)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_causal_future_tokens_do_not_change_earlier_logits() -> None:
    model = build("tiny")
    x = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_block_is_a_function_of_its_input_only() -> None:
    block = build("tiny").blocks[0]
    x = torch.randn(2, 8, 256)
    assert torch.equal(block(x), block(x.clone()))
    assert block(x).shape == x.shape


def test_sequence_longer_than_max_seq_len_is_a_config_error() -> None:
    model = build("tiny")
    with pytest.raises(ConfigError, match="max_seq_len 512"):
        model(torch.zeros(1, 513, dtype=torch.long))


@pytest.mark.parametrize(("name", "tokens"), [("1b", 1024), ("7b", 1024), ("tiny", 65536)])
def test_loss_chunks_are_at_least_1024_tokens(name: str, tokens: int) -> None:
    """A 128k vocabulary's 64 MiB of logits is 130 tokens: a head GEMM too thin for a GPU, run
    three times per chunk. Chunks hold 1024 tokens at least, more where 64 MiB holds more."""
    model = build(get_preset(name), device="meta")
    assert chunk_tokens_for(model.args.vocab_size, model.loss_chunk_bytes) == tokens
    n = 4 * 512
    estimate = activation_memory(model.args, 4, 512, 2, model.loss_chunk_bytes)
    one_chunk = activation_memory(model.args, 4, 512, 2, 4 * model.args.vocab_size * min(n, tokens))
    assert estimate == one_chunk  # the memory model counts the chunk the model computes


@pytest.mark.parametrize("chunk_tokens", [1 << 20, 7])  # one chunk, and several
def test_the_loss_over_its_own_count_is_bitwise_its_mean(chunk_tokens: int) -> None:
    """`num_items_in_batch` equal to the micro-batch's trained targets: the same loss and grads
    bitwise; another count scales the sum (what a step over several micro-batches passes)."""
    from tierzero.models.loss import chunked_cross_entropy, trained_targets

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 10, 16)
    targets = torch.randint(0, 50, (3, 10))
    targets[:, ::3] = -100
    results = []
    for count in (None, float(trained_targets(targets)), 4.0):
        head.zero_grad()
        loss = chunked_cross_entropy(head, hidden, targets, chunk_tokens, count)
        loss.backward()
        results.append((loss.detach(), head.weight.grad.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    torch.testing.assert_close(results[2][0], results[0][0] * trained_targets(targets) / 4.0)
