"""LoRA from the command line: `tierzero train --model hf:DIR --lora-r ...`, then `export`.

The run trains peft adapters on the frozen base of a small saved LLaMA (sharded safetensors, a
word-level tokenizer), with the base read unit by unit into the tiers (`tierzero.hf.lora`).
Its export is checked against transformers/peft themselves: the adapter directory loads with
`PeftModel.from_pretrained` on the base, the `--merge` directory with `from_pretrained`, and
both give the validation loss tierzero reported for the trained model, on the same
validation batches (fp32: they differ only in summation order, within 1e-5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tierzero.cli.app import app
from typer.testing import CliRunner

from tests.support.hf import sample_text
from tierzero.config import Evaluation
from tierzero.run.corpus import TextTokenizer, read_corpus
from tierzero.run.data import TokenBatches
from tierzero.run.directory import read_metrics

runner = CliRunner()
LORA = [
    "--lora-r",
    "4",
    "--lora-alpha",
    "8",
    "--lora-dropout",
    "0.0",
    "--lora-targets",
    "q_proj,v_proj",
]
COMMON = [
    "--steps",
    "3",
    "--batch-size",
    "2",
    "--seq-len",
    "32",
    "--lr",
    "1e-2",
    "--dtype",
    "fp32",
    "--json",
]


def val_loss(model: torch.nn.Module, batches: TokenBatches) -> float:
    """The next-token cross-entropy over every validation token, as tierzero's evaluate (its
    default set: the windows that hold Evaluation.eval_tokens tokens)."""
    with torch.no_grad():
        val = batches.val_batches(Evaluation.eval_tokens)
        logits = torch.cat([model(input_ids=x).logits.float().flatten(0, 1) for x, _ in val])
        return F.cross_entropy(logits, torch.cat([y.flatten() for _, y in val])).item()


def test_a_cli_lora_run_exports_an_adapter_that_gives_its_losses(hf_models, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir, run_dir = hf_models["llama"], tmp_path / "run"
    data = tmp_path / "corpus.txt"
    data.write_text(sample_text())
    result = runner.invoke(
        app,
        [
            "train",
            "--model",
            f"hf:{base_dir}",
            "--data",
            str(data),
            *LORA,
            *COMMON,
            "--offload",
            "nvme",
            "--run-dir",
            str(run_dir),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "LoRA r=4 alpha=8 on q_proj, v_proj" in result.output
    reported = [r["eval_loss"] for r in read_metrics(run_dir) if "eval_loss" in r]
    assert len(reported) == 2 and reported[-1] < reported[0]  # before training, and after step 3

    for args in ([], ["--merge"]):
        out = tmp_path / ("merged" if args else "adapter")
        result = runner.invoke(app, ["export", str(run_dir), "--out", str(out), *args])
        assert result.exit_code == 0, result.output
    tokens = read_corpus(str(data), 256, TextTokenizer(base_dir / "tokenizer.json", 0))
    batches = TokenBatches(tokens, 2, 32, seed=0)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    # the base, read unit by unit, is the base
    assert abs(val_loss(base, batches) - reported[0]) < 1e-5
    adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter"
    )
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in adapter.named_parameters())
    assert abs(val_loss(adapter, batches) - reported[-1]) < 1e-5
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert abs(val_loss(merged, batches) - reported[-1]) < 1e-5


def test_lora_in_memory_starts_and_trains_as_the_tiered_run(hf_models, tmp_path) -> None:
    """`--offload none` builds the same adapters from the same seed: the same losses."""
    losses = {}
    for offload in ("none", "host"):
        run_dir = tmp_path / offload
        result = runner.invoke(
            app,
            [
                "train",
                "--model",
                f"hf:{hf_models['llama']}",
                *LORA,
                *COMMON,
                "--data",
                str(_data(tmp_path)),
                "--offload",
                offload,
                "--run-dir",
                str(run_dir),
            ],
        )
        assert result.exit_code == 0, result.output
        losses[offload] = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert max(abs(a - b) for a, b in zip(losses["none"], losses["host"])) < 1e-5, losses


def test_lora_on_a_preset_is_refused(tmp_path) -> None:
    result = runner.invoke(
        app, ["train", "--model", "tiny", "--lora-r", "8", "--run-dir", str(tmp_path / "run")]
    )
    assert result.exit_code == 2, result.output
    assert "--lora-r adapts a Hugging Face model" in result.output


def _data(tmp_path):
    path = tmp_path / "corpus.txt"
    if not path.exists():
        path.write_text(sample_text())
    return path
