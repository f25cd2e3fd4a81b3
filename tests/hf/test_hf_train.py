"""Hugging Face models train through `tierzero train --model hf:<dir>` as in plain PyTorch.

The oracle: the same saved model loaded with `from_pretrained`, trained with
`torch.optim.AdamW` (decay on matrices, tierzero's lr schedule) on the same batches, its loss
the plain cross-entropy of its logits against the next tokens. tierzero runs with every state
kind on NVMe, fp32, from the directory's sharded safetensors, tokenizing the text with the
directory's `tokenizer.json` (LLaMA) or as bytes (GPT-2, which has none). Tolerance: the 20
losses within 1e-4 (fp32 differs only in summation order; observed under 1e-5), the trained
weights within 1e-4. Export -> `from_pretrained` gives back the exported weights bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tierzero.cli.app import app
from typer.testing import CliRunner

from tests.support.hf import plain_step, sample_text
from tierzero.adamw import decays
from tierzero.config import Config
from tierzero.run.data import TokenBatches
from tierzero.run.directory import read_metrics

runner = CliRunner()
STEPS, BATCH, SEQ, LR = 20, 2, 32, 3e-3
LOSS_TOL = WEIGHT_TOL = 1e-4


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(sample_text())
    return path


def oracle_tokens(model_dir: Path, data_file: Path) -> np.ndarray:
    """The ids tierzero should train on, computed here without tierzero's data code."""
    tokenizer = model_dir / "tokenizer.json"
    if not tokenizer.exists():
        return np.frombuffer(data_file.read_bytes(), dtype=np.uint8)
    from tokenizers import Tokenizer

    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    return np.asarray(
        Tokenizer.from_file(str(tokenizer)).encode(data_file.read_text()).ids + [eos],
        dtype=np.uint32,
    )


def plain_training(model_dir: Path, tokens: np.ndarray) -> tuple[list[float], torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    config = Config(lr=LR, total_steps=STEPS)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {
                "params": [p for p in params if decays(p)],
                "weight_decay": config.optimizer.weight_decay,
            },
            {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=config.optimizer.betas,
        eps=config.optimizer.eps,
    )
    batches = TokenBatches(tokens, BATCH, SEQ, seed=0)
    losses = []
    for step in range(STEPS):
        x, y = batches.next_batch()
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        plain_step(opt, step, config)
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_trains_like_plain_pytorch_and_exports_for_from_pretrained(
    arch, hf_models, data_file, tmp_path
):
    from transformers import AutoModelForCausalLM

    model_dir, run_dir = hf_models[arch], tmp_path / "run"
    assert (model_dir / "model.safetensors.index.json").exists() and len(
        list(model_dir.glob("*.safetensors"))
    ) > 2
    result = runner.invoke(
        app,
        [
            "train",
            "--model",
            f"hf:{model_dir}",
            "--data",
            str(data_file),
            "--steps",
            str(STEPS),
            "--batch-size",
            str(BATCH),
            "--seq-len",
            str(SEQ),
            "--lr",
            str(LR),
            "--offload",
            "nvme",
            "--dtype",
            "fp32",
            "--run-dir",
            str(run_dir),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert ("no tokenizer.json" in result.output) == (arch == "gpt2")  # byte-level, with a warning
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    expected, trained = plain_training(model_dir, oracle_tokens(model_dir, data_file))
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.3
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= LOSS_TOL, (losses, expected)

    out = tmp_path / "export"
    out.mkdir()
    result = runner.invoke(
        app, ["export", str(run_dir), "--out", str(out), "--max-shard-size", "60KB"]
    )
    assert result.exit_code == 0, result.output
    assert (out / "config.json").exists() and (out / "model.safetensors.index.json").exists()
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    state, reference = loaded.state_dict(), trained.state_dict()
    assert set(state) <= set(exported)
    for name, value in state.items():
        assert value.dtype == torch.float32 and torch.equal(value, exported[name]), name
        assert torch.allclose(value, reference[name], atol=WEIGHT_TOL, rtol=0), name
    assert (
        loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    ) == trained.config.tie_word_embeddings
