"""QLoRA through the CLI, as a user of peft + bitsandbytes would check it: a tiny chat LLaMA
(word-level tokenizer, chat template, tied embedding), fp32, LoRA r = 8 on an NF4 base tiered
to NVMe, trained on chat records. The loss falls; `tierzero generate --run-dir` greedily makes
the tokens that peft makes with the exported adapter over the same base loaded by transformers
in bitsandbytes' 4-bit NF4 (`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`:
the linear layers quantised, the embedding and head not), on the same chat prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tierzero.cli.app import app
from typer.testing import CliRunner

from tests.support.hf import sample_text, save_chat_llama
from tierzero.run.directory import read_metrics

runner = CliRunner()
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
WORDS = "def return import class for in if else while with as from".split()
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_chat_llama(
        tmp_path_factory.mktemp("qlora-cli") / "llama", sample_text(), TEMPLATE, "[UNK]"
    )


def chat_records(path: Path) -> Path:
    """40 chats of one user turn and one assistant reply in the model's words."""
    with path.open("w") as f:
        for i in range(40):
            messages = [
                {"role": "user", "content": " ".join(WORDS[i % 7 : i % 7 + 3])},
                {"role": "assistant", "content": " ".join(WORDS[i % 5 : i % 5 + 2])},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def invoke(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def bitsandbytes_peft(model_dir: Path, adapter: Path) -> torch.nn.Module:
    """The base as transformers loads it in bitsandbytes' NF4, with peft's model of the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantized = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    base = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=quantized, device_map="cpu", torch_dtype=torch.float32
    )
    return PeftModel.from_pretrained(base, adapter).eval()


def test_an_nf4_lora_run_generates_what_peft_over_bitsandbytes_does(model_dir, tmp_path) -> None:
    import bitsandbytes as bnb

    run_dir = tmp_path / "run"
    invoke(
        "train",
        "--model",
        f"hf:{model_dir}",
        "--data",
        str(chat_records(tmp_path / "chats.jsonl")),
        "--steps",
        "8",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--dtype",
        "fp32",
        "--lr",
        "3e-2",
        "--lora-r",
        "8",
        "--quantize-base",
        "nf4",
        "--offload",
        "nvme",
        "--eval-every",
        "0",
        "--run-dir",
        str(run_dir),
    )
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert len(losses) == 8 and sum(losses[-2:]) < sum(losses[:2]) - 0.1, losses

    prompts = ["def return import", "class for in", "while with as"]
    out = json.loads(
        invoke(
            "generate",
            "--run-dir",
            str(run_dir),
            *(arg for p in prompts for arg in ("--prompt", p)),
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--offload",
            "nvme",
            "--json",
        )
    )
    adapter = tmp_path / "adapter"
    invoke("export", str(run_dir), "--out", str(adapter))
    peft = bitsandbytes_peft(model_dir, adapter)
    base = peft.get_base_model()
    layers = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 2 * 7  # every linear layer of the blocks; not the tied head
    assert not isinstance(base.lm_head, bnb.nn.Linear4bit)
    assert any(
        n.endswith("lora_B.default.weight") and w.abs().sum() > 0
        for n, w in peft.named_parameters()
    )  # the adapters trained
    for prompt, g in zip(prompts, out["generations"], strict=True):
        assert g["prompt"] == prompt and g["new_ids"], g
        ids = torch.tensor([g["prompt_ids"]])
        with torch.no_grad():
            made = peft.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                pad_token_id=0,
            )
        assert g["new_ids"] == made[0, ids.shape[1] :].tolist()[: len(g["new_ids"])], prompt
