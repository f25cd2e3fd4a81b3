"""The vertical schedule on a Hugging Face decoder, with dropout, against the horizontal one and
plain PyTorch.

fp32, one rank, every state on NVMe, k = 3 micro-batches a step: a LLaMA with attention dropout
0.1, fully fine-tuned and with LoRA adapters (lora dropout 0.1, the base frozen), trained
vertically leaves losses and weights bitwise equal to the horizontal schedule and to a plain
loop: the model from `from_pretrained` (peft on it for LoRA), `torch.optim.AdamW` with
accumulation, each decoder layer's call drawing its dropout masks from the generator seeded for
(step, micro-batch, unit) as tierzero documents (`tierzero.models.draws.draw_seed`). Other
families (GPT-2's position table and dropouts, MPT's tuple-returning layers, Gemma2's
alternating sliding-window masks) run vertically as horizontally, bitwise.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from tests.support.engine import engine_config
from tests.support.hf import save_model
from tierzero import Config, Engine, Placement, Tier
from tierzero.adamw import decays, implementation
from tierzero.config import Schedule
from tierzero.errors import ConfigError
from tierzero.hf import load_model
from tierzero.hf.lora import LoraSpec, add_lora, materialise_lora
from tierzero.lr import lr_at
from tierzero.models.draws import draw_seed
from tierzero.run.data import TokenBatches, default_corpus

K, STEPS, SEED = 3, 2, 0
NVME = Placement(*[Tier.NVME] * 5)
LORA = LoraSpec(r=4, alpha=8, dropout=0.1, targets=("q_proj", "v_proj"))


def batches() -> TokenBatches:
    return TokenBatches(default_corpus(1 << 16), 2, 32, seed=0)


# this file's values: no budgets (the engine chooses)
config = partial(
    engine_config,
    dtype="fp32",
    total_steps=STEPS,
    accumulate=K,
    seed=SEED,
    host_budget=None,
    gpu_budget=None,
)


def engine_run(
    model_dir: Path, path: Path, schedule: str, lora: bool, activation_budget: int | None = None
) -> tuple[list[float], dict, bool]:
    """Losses, weights, and whether it ran vertically; with `activation_budget` the waiting
    activations must spill to NVMe."""
    hf = load_model(f"hf:{model_dir}")
    model, weights = (add_lora(hf, LORA, hf.weights), None) if lora else (hf.model, model_dir)
    data = batches()
    with Engine(
        model, config(path, schedule=schedule, activation_budget=activation_budget), weights=weights
    ) as engine:
        losses = [engine.train_micro_batch(data.next_batch()) for _ in range(STEPS * K)]
        if activation_budget is not None:
            assert engine.vertical.store.spilled > 0
        return [t.item() for t in losses], engine.master_state_dict(), bool(engine.vertical.on)


def seed_layers(layers: torch.nn.ModuleList, position: list[int]) -> list[RemovableHandle]:
    """Each layer's call draws from torch's generator seeded for (step, micro-batch, unit),
    unit i + 1 for layer i, and leaves torch's stream as it found it; the hooks' handles."""

    def enter(i: int, module, args) -> None:
        module.saved_rng = torch.get_rng_state()
        torch.manual_seed(draw_seed(SEED, position[0], position[1], i + 1))

    def leave(module, args, out) -> None:
        torch.set_rng_state(module.saved_rng)

    handles = []
    for i, layer in enumerate(layers):
        handles.append(
            layer.register_forward_pre_hook(lambda module, args, i=i: enter(i, module, args))
        )
        handles.append(layer.register_forward_hook(leave))
    return handles


def plain_run(model_dir: Path, lora: bool) -> tuple[list[float], dict[str, torch.Tensor], set[str]]:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:  # the adapters start where tierzero's do (peft's init under tierzero's per-unit seed)
        start = materialise_lora(
            add_lora(load_model(f"hf:{model_dir}"), LORA, model_dir), SEED, "cpu"
        )
        model = get_peft_model(model, LORA.config())
        model.load_state_dict(
            {n: p for n, p in start.state_dict().items() if "lora_" in n}, strict=False
        )
    layers = model.get_base_model().model.layers if lora else model.model.layers
    position = [0, 0]
    seed_layers(layers, position)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = config(model_dir, schedule="horizontal")
    opt = torch.optim.AdamW(
        [
            {
                "params": [p for p in params if decays(p)],
                "weight_decay": cfg.optimizer.weight_decay,
            },
            {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
        ],
        lr=cfg.optimizer.lr,
        betas=cfg.optimizer.betas,
        eps=cfg.optimizer.eps,
        **implementation(torch.device("cpu")),
    )
    data, losses = batches(), []
    for step in range(STEPS):
        for micro in range(K):
            position[:] = step, micro
            x, y = data.next_batch()
            loss = F.cross_entropy(model(input_ids=x).logits.float().flatten(0, 1), y.flatten())
            (loss / K).backward()
            losses.append(loss.item())
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.optimizer)
        opt.step()
        opt.zero_grad()
    named = list(model.named_parameters(remove_duplicate=False))
    return losses, {n: p.detach() for n, p in named}, {n for n, p in named if p.requires_grad}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_vertical_hf_with_dropout_is_bitwise_horizontal_and_plain_pytorch(
    tmp_path, lora: bool
) -> None:
    model_dir = save_model("llama", tmp_path / "llama", attention_dropout=0.1)
    (tmp_path / "h").mkdir(), (tmp_path / "v").mkdir()
    h_losses, h_weights, h_on = engine_run(model_dir, tmp_path / "h", "horizontal", lora)
    # room for two of the six waiting block inputs (full: and the tied embedding's grad): the
    # rest spill
    budget = 4 * 2 * 32 * 64 * (2 if lora else 6)
    v_losses, v_weights, v_on = engine_run(
        model_dir, tmp_path / "v", "vertical", lora, activation_budget=budget
    )
    assert v_on and not h_on
    assert v_losses == h_losses
    assert v_weights.keys() == h_weights.keys()
    for name in h_weights:
        assert torch.equal(v_weights[name], h_weights[name]), name
    losses, weights, trained = plain_run(model_dir, lora)
    assert v_losses == losses
    assert trained and (
        all("lora_" in n for n in trained) if lora else len(trained) == len(weights)
    )
    for name, value in weights.items():
        assert torch.equal(v_weights[name], value), name


def test_dropout_draws_are_seeded_per_micro_batch_and_unit(tmp_path) -> None:
    """The oracle's masks matter: with the layers' draws seeded otherwise the plain loop's
    losses differ (so the equality above is about the masks, not a model without dropout)."""
    model_dir = save_model("llama", tmp_path / "llama", attention_dropout=0.1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    x, _ = batches().next_batch()
    draws = []
    for position in ([0, 0], [0, 1]):
        handles = seed_layers(model.model.layers, position)
        with torch.no_grad():
            draws.append(model(input_ids=x).logits)
        for handle in handles:
            handle.remove()
    assert not torch.equal(draws[0], draws[1])


def test_auto_runs_hf_decoders_vertically_when_accumulating(tmp_path) -> None:
    model_dir = save_model("llama", tmp_path / "llama", attention_dropout=0.1)
    assert Config().execution.schedule is Schedule.AUTO

    def chosen(k: int) -> bool:
        (tmp_path / str(k)).mkdir()
        hf = load_model(f"hf:{model_dir}")
        cfg = Config(placement=NVME, nvme_path=[str(tmp_path / str(k))], dtype="fp32", accumulate=k)
        with Engine(hf.model, cfg, weights=model_dir) as engine:
            engine.train_micro_batch(batches().next_batch())
            return bool(engine.vertical.on)

    assert chosen(2) and not chosen(1)


FAMILIES = {  # beyond LLaMA: a prelude with dropout, layers returning tuples, alternating attention
    "gpt2": dict(
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    ),
    "mpt": dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=128),
    "gemma2": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        sliding_window=8,
        attention_dropout=0.1,
    ),
}


def save_family(arch: str, path: Path, **overrides) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        arch, vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, **overrides
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_other_families_run_vertically_as_horizontally(tmp_path, arch: str) -> None:
    model_dir = save_family(arch, tmp_path / arch, **FAMILIES[arch])
    runs = {}
    for schedule in ("horizontal", "vertical"):
        (tmp_path / schedule).mkdir()
        runs[schedule] = engine_run(model_dir, tmp_path / schedule, schedule, lora=False)
    (h_losses, h_weights, _), (v_losses, v_weights, v_on) = runs["horizontal"], runs["vertical"]
    assert v_on and v_losses == h_losses
    for name in h_weights:
        assert torch.equal(v_weights[name], h_weights[name]), name


def test_a_final_norm_without_parameters_stays_horizontal(tmp_path) -> None:
    """OLMo's final norm runs inside its model's forward, not in the head unit: `auto` keeps it
    horizontal, `vertical` is refused in one sentence."""
    model_dir = save_family(
        "olmo",
        tmp_path / "olmo",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )
    hf = load_model(f"hf:{model_dir}")
    with Engine(hf.model, config(tmp_path / "a", schedule="auto"), weights=model_dir) as engine:
        engine.train_micro_batch(batches().next_batch())
        assert engine.vertical.on is False
    hf = load_model(f"hf:{model_dir}")
    with Engine(hf.model, config(tmp_path / "v", schedule="vertical"), weights=model_dir) as engine:
        with pytest.raises(ConfigError, match="final norm has no parameters"):
            engine.train_micro_batch(batches().next_batch())
