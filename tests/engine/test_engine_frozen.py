"""Frozen parameters, parameters without a gradient, and LoRA adapters, against plain PyTorch.

Compared: `tierzero.Engine` versus `ReferenceTrainer` (`torch.optim.AdamW` over the parameters
that require grad), fp32, one rank, same seed and batches: bitwise equal losses and weights.
Frozen parameters are stored as params only (no grad, master or Adam state); a parameter with
no gradient in a step is skipped as torch's AdamW skips it, and keeps its own step count.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from tests.support.engine import SMALL, batches, engine_config
from tierzero import Config, Placement, StateKind, Tier, models
from tierzero.engine import Engine
from tierzero.errors import ConfigError
from tierzero.models.llama import LOSS_CHUNK_BYTES
from tierzero.planning.ledger import activation_memory
from tierzero.planning.swapplan import Op
from tierzero.reference import ReferenceTrainer

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
PLACEMENTS = {
    "all-gpu": Placement(),
    "mixed": Placement(Tier.NVME, Tier.HOST, Tier.NVME, Tier.HOST, Tier.NVME),
}


# this file's values: pieces smaller than a unit
config = partial(engine_config, piece_numel=6144, warmup_steps=2, total_steps=6)


def assert_bitwise(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == expected.keys()
    for key in expected:
        assert torch.equal(weights[key], expected[key]), key


def lora_model(seed: int = 0) -> nn.Module:
    """The built-in model under `peft` LoRA adapters on the attention's q and v (base frozen)."""
    base = models.build(SMALL, seed=seed)
    return get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["wq", "wv"], lora_dropout=0.0)
    )


def train_both(
    model: nn.Module, cfg: Config, batch_list: list
) -> tuple[list[float], dict, list[float], dict, Engine]:
    trainer = ReferenceTrainer(copy.deepcopy(model), cfg)
    ref_losses = [trainer.train_step(b) for b in batch_list]
    with Engine(model, cfg) as engine:
        losses = [engine.train_step(b) for b in batch_list]
        weights = engine.master_state_dict()
    return losses, weights, ref_losses, trainer.master_state_dict(), engine


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_frozen_parameters_bitwise_and_unchanged(tmp_path, name: str) -> None:
    model = models.build(SMALL, seed=0)
    frozen = {
        "tok_emb.weight",
        "blocks.1.attn.wq.weight",
        "blocks.2.mlp.w_up.weight",
        "norm.weight",
    }
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = batches()
    losses, weights, ref_losses, ref_weights, engine = train_both(
        model, config(tmp_path, PLACEMENTS[name]), [data.next_batch() for _ in range(3)]
    )
    assert losses == ref_losses
    assert_bitwise(weights, ref_weights)
    for n in frozen:
        assert torch.equal(weights[n], before[n]), n
    # tied to the frozen embedding
    assert torch.equal(weights["head.weight"], before["tok_emb.weight"])
    assert not torch.equal(weights["blocks.1.attn.wk.weight"], before["blocks.1.attn.wk.weight"])
    embedding = engine.units[0]
    assert embedding.trainable_numel == 0 and engine.keys(StateKind.MASTER, embedding) == []


def test_lora_on_frozen_base_bitwise_loss_falls_only_adapters_change(tmp_path) -> None:
    model = lora_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = batches().next_batch()  # one batch again and again: the adapters fit it
    cfg = config(tmp_path, lr=1e-2, warmup_steps=0, total_steps=6)
    losses, weights, ref_losses, ref_weights, engine = train_both(model, cfg, [batch] * 6)
    assert losses == ref_losses
    assert_bitwise(weights, ref_weights)
    assert losses[-1] < losses[0] - 0.1
    changed = {n for n in before if not torch.equal(weights[n], before[n])}
    assert changed and changed <= trainable
    # a base parameter has a param and nothing else: 4 B/param in fp32 (2 in bf16), not 20;
    # each block's adapters are one aligned trainable prefix with grad, master and moments
    assert [u.trainable_numel for u in engine.units] == [0, 2048, 2048, 2048, 0]
    padded = sum(u.padded_numel for u in engine.units)
    assert engine.parts.sizing.current.tiers[Tier.NVME].homes_bytes == padded * 4 + 3 * 2048 * 16
    # the frozen embedding is bound in backward only by the tied head's call: its own call
    # (token ids in, no weight grad) is neither refetched nor recomputed
    recomputed = [
        op for op in engine.opened.train_plan.ops if op.op is Op.COMPUTE and op.phase == "backward"
    ]
    assert [op.unit for op in recomputed].count(0) == 1


class SideBlock(nn.Module):
    """A residual block whose `side` branch runs only when asked: its parameters then get no
    grad."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.main = nn.Linear(dim, dim)
        self.side = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = h + torch.tanh(self.main(h))
        return h + 0.5 * self.side(h) if use_side else h


class SideModel(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(SideBlock(dim) for _ in range(2))
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, sides: tuple[bool, bool]) -> torch.Tensor:
        h = self.inp(x)
        for block, use in zip(self.blocks, sides):
            h = block(h, use)
        return (self.out(h) - y).pow(2).mean()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_params_without_grad_are_skipped_as_torch_adamw_skips_them(
    tmp_path, overlap: bool, accumulate: int
) -> None:
    """blocks.0.side is unused in some steps (and, accumulating, in some micro-batches only):
    torch's AdamW neither decays nor moves it then, and bias-corrects it with its own count."""
    torch.manual_seed(0)
    model = SideModel()
    gen = torch.Generator().manual_seed(1)
    uses = [(True, True), (False, True), (False, False), (True, True), (False, True), (True, False)]
    if accumulate == 2:  # per micro-batch: unused in both, or in one of the two
        uses = [
            (False, True),
            (False, True),
            (True, True),
            (False, True),
            (False, False),
            (False, True),
        ]
    batch_list = [
        (torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen), u) for u in uses
    ]
    cfg = config(
        tmp_path,
        Placement(Tier.NVME, Tier.HOST, Tier.NVME, Tier.NVME, Tier.HOST),
        piece_numel=2048,
        overlap_step=overlap,
        accumulate=accumulate,
        total_steps=len(uses) // accumulate,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, weights, ref_losses, ref_weights, engine = train_both(model, cfg, batch_list)
    assert losses == ref_losses
    assert_bitwise(weights, ref_weights)
    assert not torch.equal(weights["blocks.0.side.weight"], before["blocks.0.side.weight"])
    if accumulate == 1:
        assert engine.parts.counters.param_steps.state_dict() == {
            "blocks.0.side.weight": 3,
            "blocks.0.side.bias": 3,
            "blocks.1.side.weight": 2,
            "blocks.1.side.bias": 2,
        }
    else:
        assert engine.parts.counters.param_steps.state_dict() == {
            "blocks.0.side.weight": 2,
            "blocks.0.side.bias": 2,
        }


def test_checkpoint_resume_and_export_keep_frozen_weights_and_step_counts(tmp_path) -> None:
    """A run resumed from a checkpoint finishes bitwise equal to one that was not stopped (the
    per-parameter step counts are saved with it), and export writes the frozen weights too."""
    from safetensors.torch import load_file

    from tierzero.checkpoint.export import export_checkpoint

    torch.manual_seed(0)
    model = SideModel()
    model.inp.weight.requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    uses = [(False, True), (True, True), (False, True), (True, False), (False, True)]
    batch_list = [
        (torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen), u) for u in uses
    ]
    cfg = config(tmp_path, piece_numel=2048, total_steps=len(uses))
    fresh = copy.deepcopy(model)
    frozen = model.inp.weight.detach().clone()
    with Engine(model, cfg) as engine:
        for b in batch_list[:3]:
            engine.train_step(b)
        engine.save_checkpoint(tmp_path / "run")
        saved = engine.master_state_dict()
        for b in batch_list[3:]:
            engine.train_step(b)
        straight = engine.master_state_dict()
    resumed_cfg = config(tmp_path, piece_numel=2048, total_steps=len(uses))
    resumed_cfg = resumed_cfg.replace(nvme_path=[str(tmp_path / "nvme2")])
    with Engine(fresh, resumed_cfg) as engine:
        engine.load_checkpoint(tmp_path / "run")
        assert engine.parts.counters.param_steps.state_dict() == {
            "blocks.0.side.weight": 2,
            "blocks.0.side.bias": 2,
        }
        for b in batch_list[3:]:
            engine.train_step(b)
        assert_bitwise(engine.master_state_dict(), straight)
    export_checkpoint(tmp_path / "run", tmp_path / "model.safetensors")
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert_bitwise(exported, saved)
    assert torch.equal(exported["inp.weight"], frozen)


def test_budget_checks_count_frozen_parameters_as_params_only(tmp_path) -> None:
    """A host budget that holds the LoRA model's state in host memory but not the same model's
    with every parameter trained: the dense one is refused before anything is written, the
    LoRA one trains within it."""
    host = Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)
    probe = Engine(lora_model(), config(tmp_path, host))
    need = probe.parts.sizing.current.host_memory.peak_bytes
    dense_need = Engine(
        models.build(SMALL, seed=0), config(tmp_path, host)
    ).parts.sizing.current.host_memory.peak_bytes
    act = activation_memory(SMALL, 4, 32, 4, LOSS_CHUNK_BYTES)  # reserved at the first forward
    budget = str(need + act.total_bytes)
    assert dense_need > need + act.total_bytes
    with pytest.raises(ConfigError, match="budget .* is too small"):
        Engine(models.build(SMALL, seed=0), config(tmp_path, host, host_budget=budget))
    with Engine(lora_model(), config(tmp_path, host, host_budget=budget)) as engine:
        engine.train_step(batches().next_batch())
        assert engine.parts.tiers.host_pool.peak_bytes <= engine.parts.tiers.host_pool.budget_bytes
