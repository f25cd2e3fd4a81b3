"""LoRA adapters (peft) on a frozen Hugging Face LLaMA base, trained through the engine.

The base is a small random-weight `LlamaForCausalLM` saved with `save_pretrained` (sharded
safetensors), built by `tierzero.hf` and read into memory; `peft` puts LoRA adapters on its
attention's q and v projections and freezes the rest. Trained in bf16 with every state on
NVMe: the loss falls, only adapter weights change, the base's files are untouched, and the
NVMe store holds about 2 bytes per base parameter (frozen params are stored once, as bf16
params, with no grad, master weight or Adam state).
"""

from __future__ import annotations

import hashlib

import torch
from peft import LoraConfig, get_peft_model

from tests.support.hf import save_model
from tierzero import Config, Placement, Tier
from tierzero.engine import Engine
from tierzero.hf import load_model, materialise
from tierzero.run.data import TokenBatches, default_corpus

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)


def digest(folder) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.iterdir())
        if f.is_file()
    }


def test_lora_on_a_frozen_hf_llama_base(tmp_path) -> None:
    base_dir = save_model(
        "llama",
        tmp_path / "base",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        vocab_size=1024,
        shard="2MB",
    )
    before = digest(base_dir)
    hf = load_model(f"hf:{base_dir}")
    model = get_peft_model(
        materialise(hf, seed=0, weights=hf.weights),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    base = {
        n: p.detach().to(torch.bfloat16).float()
        for n, p in model.named_parameters()
        if not p.requires_grad
    }
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    base_numel = sum(p.numel() for n, p in model.named_parameters() if not p.requires_grad)
    batch = TokenBatches(default_corpus(1 << 16), batch_size=2, seq_len=64, seed=0).next_batch()
    cfg = Config(
        placement=NVME,
        nvme_path=[str(tmp_path / "nvme")],
        dtype="bf16",
        lr=1e-2,
        host_budget="1GiB",
        gpu_budget="1GiB",
    )
    with Engine(model, cfg) as engine:
        losses = [engine.train_step(batch) for _ in range(4)]
        weights = engine.master_state_dict()
    assert losses[-1] < losses[0] - 0.1, losses
    changed = {n for n in weights if n in base and not torch.equal(weights[n], base[n])}
    assert not changed
    assert any(
        not torch.equal(weights[n], torch.zeros_like(weights[n])) for n in adapters if "lora_B" in n
    )
    assert digest(base_dir) == before
    # bytes the drive holds (allocated blocks; chunk files are sparse past their data): the
    # params, base and adapters, ~2.08 B per base param here (array metadata included); all
    # state, the adapters' grads, master weights and moments too, ~2.39 (2.6M base params)
    nvme = tmp_path / "nvme"
    params = sum(f.stat().st_blocks * 512 for f in (nvme / "param").rglob("*") if f.is_file())
    total = sum(f.stat().st_blocks * 512 for f in nvme.rglob("*") if f.is_file())
    print(
        f"loss {losses[0]:.2f} -> {losses[-1]:.2f}; nvme bytes per base param: params "
        f"{params / base_numel:.2f}, all state {total / base_numel:.2f}"
    )  # the README's figures (-s)
    assert 1.95 <= params / base_numel <= 2.2, params / base_numel
    assert total / base_numel <= 2.5, total / base_numel


def test_lora_export_loads_as_a_peft_adapter_and_merged(tmp_path) -> None:
    """Export of a LoRA run: the adapter directory loads with `PeftModel.from_pretrained` on the
    base and holds exactly the trained weights; `--merge` loads with `from_pretrained`, equals
    peft's own `merge_and_unload` of that adapter and gives its loss."""
    from peft import PeftModel
    from tierzero.cli.app import app
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from tierzero.hf import describe

    base_dir = save_model("llama", tmp_path / "base")
    hf = load_model(f"hf:{base_dir}")
    model = get_peft_model(
        materialise(hf, seed=0, weights=hf.weights),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    data = TokenBatches(default_corpus(1 << 16), batch_size=2, seq_len=32, seed=0)
    cfg = Config(placement=NVME, nvme_path=[str(tmp_path / "nvme")], dtype="fp32", lr=1e-2)
    with Engine(model, cfg) as engine:
        for _ in range(3):
            engine.train_step(data.next_batch())
        trained = engine.master_state_dict()
        engine.save_checkpoint(tmp_path / "run", model=describe(hf, model))
    runner = CliRunner()
    plain = runner.invoke(
        app, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")]
    )
    assert plain.exit_code == 0, plain.output
    merged = runner.invoke(
        app, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "merged"), "--merge"]
    )
    assert merged.exit_code == 0, merged.output
    assert {f.name for f in (tmp_path / "adapter").iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }

    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter"
    )
    state = dict(loaded.named_parameters(remove_duplicate=False))
    assert {n for n in trained if "lora_" in n} <= set(state)
    for name, value in trained.items():
        assert torch.equal(state[name].detach(), value), name
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    reference = loaded.merge_and_unload()
    for name, value in reference.state_dict().items():
        assert torch.equal(whole.state_dict()[name], value), name
    x, _ = data.next_batch()
    with torch.no_grad():
        adapter = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter"
        )
        assert (
            abs(
                adapter(input_ids=x, labels=x).loss.item()
                - whole(input_ids=x, labels=x).loss.item()
            )
            < 1e-5
        )


def test_export_of_lora_tensors_without_their_config_is_refused(tmp_path) -> None:
    from tierzero.cli.app import app
    from typer.testing import CliRunner

    hf = load_model(f"hf:{save_model('llama', tmp_path / 'base')}")
    model = get_peft_model(
        materialise(hf, seed=0, weights=hf.weights),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.0),
    )
    with Engine(
        model, Config(placement=NVME, nvme_path=[str(tmp_path / "nvme")], dtype="fp32")
    ) as engine:
        engine.save_checkpoint(tmp_path / "run", model=hf.description())
    result = CliRunner().invoke(
        app, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]
    )
    assert result.exit_code == 2, result.output
    assert "holds LoRA tensors" in result.output and "but not their peft config" in result.output
