"""LoRA without `--lora-targets` on families peft has no default for (DeepSeek-V2's MLA
attention, ERNIE-4.5-MoE, Llama 4): every plain linear layer of the decoder layers is adapted
but the names peft takes for the fused experts' tensors, the run says so and names them, and it
trains; the embedding, the head and the routers are not adapted. Naming those MLP names is
refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tierzero.cli.app import app
from typer.testing import CliRunner

from tierzero.run.data import default_corpus
from tierzero.run.directory import read_metrics

COMMON = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MLA = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8}
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP = {"gate_proj", "up_proj", "down_proj"}
# family: (its config, the names adapted, the names left out: peft 0.21 on transformers 5 takes
# DeepSeek's and ERNIE's MLP names for their fused experts, even in shared experts and dense layers)
FAMILIES = {
    "deepseek_v2": (
        {
            **MLA,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "topk_group": 1,
        },
        {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"},
        MLP,
    ),
    "ernie4_5_moe": (
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        ATTENTION,
        MLP,
    ),
    "llama4_text": (  # a dense layer, then an MoE one with a shared expert and a router
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 96,
            "head_dim": 16,
            "interleave_moe_layer_step": 2,
        },
        ATTENTION | MLP,
        set(),
    ),
}
TRAIN = ["--steps", "4", "--batch-size", "2", "--seq-len", "32", "--lr", "1e-2", "--dtype", "fp32"]


def save(arch: str, path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **{**COMMON, **FAMILIES[arch][0]})
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_lora_without_targets_adapts_every_linear_layer_of_the_decoder_layers(arch, tmp_path):
    _, targets, left_out = FAMILIES[arch]
    model_dir = save(arch, tmp_path / arch)
    data = tmp_path / "ids.npy"
    np.save(data, default_corpus(1 << 14).astype(np.uint16))
    run_dir, out = tmp_path / "run", tmp_path / "adapter"
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--model",
            f"hf:{model_dir}",
            "--data",
            str(data),
            *TRAIN,
            "--offload",
            "nvme",
            "--lora-r",
            "4",
            "--run-dir",
            str(run_dir),
        ],
    )
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    note = (
        f"peft has no default LoRA targets for {arch}: every linear layer of its decoder "
        "layers is adapted"
    )
    if left_out:
        note += (
            f" except {', '.join(sorted(left_out))} (peft takes those names for the "
            "experts' fused tensors"
        )
    assert note in said, said
    assert f"LoRA r=4 alpha=16 on {', '.join(sorted(targets))}:" in said
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses

    result = CliRunner().invoke(app, ["export", str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == targets
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        adapted = {name.split(".lora_")[0].removeprefix("base_model.model.") for name in f.keys()}
    assert all(".layers." in name for name in adapted), adapted  # not the embedding or head
    assert {name.rpartition(".")[2] for name in adapted} == targets  # no router


def test_lora_targets_that_peft_takes_for_fused_experts_are_refused(tmp_path):
    model_dir = save("ernie4_5_moe", tmp_path / "ernie")
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--model",
            f"hf:{model_dir}",
            "--steps",
            "1",
            "--lora-r",
            "4",
            "--lora-targets",
            "q_proj,gate_proj,up_proj",
            "--run-dir",
            str(tmp_path / "run"),
        ],
    )
    assert result.exit_code == 2, result.output
    assert "as the experts' fused tensors, which tierzero cannot train yet" in result.output
    assert "Traceback" not in result.output
