"""GPT-2, OPT and OLMo split like the LLaMA family: no root unit held for the whole pass.

GPT-2 and OPT add a learned position table before the blocks (`tierzero.hf.prelude`: it joins the
token embedding in the embedding unit), OPT's head calls its decoder directly and registers its
final norm before its layers, and OLMo's final norm has no parameters. Each trains through the
engine (fp32, every state on NVMe, 3 steps) bitwise equal to plain PyTorch: the model loaded with
`from_pretrained`, `torch.optim.AdamW` (fused, decay on matrices, tierzero's lr schedule), the
cross-entropy of its logits against the next tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.hf import plain_adamw, plain_step, save_model
from tierzero import Config, Engine
from tierzero.hf import SplitCausalLM, load_model
from tierzero.layout.partition import partition
from tierzero.run.data import TokenBatches, default_corpus

STEPS = 3
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=256,
    max_position_embeddings=128,
)


def save(arch: str, path: Path) -> Path:
    from transformers import AutoModelForCausalLM, OlmoConfig, OPTConfig

    if arch == "gpt2":
        return save_model("gpt2", path)
    torch.manual_seed(0)
    config = (
        OPTConfig(**SMALL, ffn_dim=128, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0)
        if arch == "opt"
        else OlmoConfig(
            **SMALL, intermediate_size=128, pad_token_id=0, bos_token_id=None, eos_token_id=1
        )
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="40KB")
    return path


def plain(model_dir: Path, data: TokenBatches, config: Config) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = plain_adamw(model, config)
    for step in range(STEPS):
        x, y = data.next_batch()
        F.cross_entropy(model(input_ids=x).logits.float().flatten(0, 1), y.flatten()).backward()
        plain_step(opt, step, config)
    return dict(model.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize("arch", ["gpt2", "opt", "olmo"])
def test_split_without_a_root_unit_and_trains_bitwise_as_plain_pytorch(arch, tmp_path):
    model_dir = save(arch, tmp_path / arch)
    hf = load_model(model_dir)
    assert isinstance(hf.model, SplitCausalLM)
    units = partition(hf.model)
    assert [u.kind for u in units] == ["embedding", "block", "block", "head"]
    embedding = {n for s in units[0].slots for n in s.names}
    if arch != "olmo":  # the position table is the embedding unit's
        assert any("wpe" in n or "embed_positions" in n for n in embedding), embedding

    config = Config(
        offload="nvme",
        device="cpu",
        dtype="fp32",
        nvme_path=[str(tmp_path / "nvme")],
        lr=3e-3,
        total_steps=STEPS,
    )
    data = lambda: TokenBatches(default_corpus(1 << 16), 2, 32, seed=0)  # noqa: E731
    batches = data()
    with Engine(hf.model, config, weights=model_dir) as engine:
        for _ in range(STEPS):
            engine.train_step(batches.next_batch())
        trained = engine.master_state_dict()
    expected = plain(model_dir, data(), config)
    assert set(expected) <= set(trained)
    for name, value in expected.items():
        assert torch.equal(trained[name], value.detach()), name
