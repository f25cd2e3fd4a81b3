"""`--weight-decay`, `--adam-betas` and `--adam-eps` reach the engine: a tiered run with weight
decay 0 ends bitwise equal to plain `torch.optim.AdamW` (one parameter group, weight decay 0, the
same betas, eps, lr schedule, implementation, initial weights and batches); bad values are one
sentence, exit 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tierzero.cli.app import app
from typer.testing import CliRunner

from tierzero import Config, models
from tierzero.adamw import implementation
from tierzero.lr import lr_at
from tierzero.run.data import TokenBatches, default_corpus

runner = CliRunner()
STEPS, BATCH, SEQ = 3, 2, 32


def test_optimizer_flags_reach_the_engine(tmp_path) -> None:
    model = models.build("tiny", seed=0)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"},
        str(tmp_path / "w.safetensors"),
    )
    tokens = default_corpus(1 << 18)
    np.save(tmp_path / "tokens.npy", tokens.astype(np.uint16))
    result = runner.invoke(
        app,
        [
            "train",
            "--steps",
            str(STEPS),
            "--batch-size",
            str(BATCH),
            "--seq-len",
            str(SEQ),
            "--dtype",
            "fp32",
            "--offload",
            "nvme",
            "--weights",
            str(tmp_path / "w.safetensors"),
            "--data",
            str(tmp_path / "tokens.npy"),
            "--weight-decay",
            "0",
            "--adam-betas",
            "0.8,0.9",
            "--adam-eps",
            "1e-6",
            "--run-dir",
            str(tmp_path / "run"),
        ],
    )
    assert result.exit_code == 0, result.output
    saved = (tmp_path / "run" / "config.toml").read_text()
    assert (
        "weight_decay = 0.0" in saved and "betas = [0.8, 0.9]" in saved and "eps = 1e-06" in saved
    )
    exported = runner.invoke(
        app, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "out.safetensors")]
    )
    assert exported.exit_code == 0, exported.output

    schedule = Config(total_steps=STEPS)
    # fused rounds as the engine's does
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=schedule.optimizer.lr,
        betas=(0.8, 0.9),
        eps=1e-6,
        weight_decay=0.0,
        **implementation(torch.device("cpu")),
    )
    data = TokenBatches(tokens, BATCH, SEQ, seed=0)
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule.optimizer)
        model(*data.next_batch()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    weights = load_file(str(tmp_path / "out.safetensors"))
    for name, param in model.state_dict().items():
        assert torch.equal(weights[name], param), name


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--adam-betas", "0.9"], "--adam-betas '0.9' is not two numbers"),
        (["--adam-betas", "0.9,1.0"], "--adam-betas must be two numbers in [0, 1)"),
        (["--adam-betas", "0.9,nan"], "--adam-betas must be two numbers in [0, 1)"),
        (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0"),
        (
            ["--weight-decay", "nan"],
            "--weight-decay must be a finite number >= 0, got nan",
        ),  # trained to a NaN loss
        (["--adam-eps", "0"], "--adam-eps must be a finite number > 0"),
        (
            ["--adam-eps", "inf"],
            "--adam-eps must be a finite number > 0, got inf",
        ),  # froze every weight
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--clip-grad-norm", "nan"], "--clip-grad-norm must be a finite number > 0, got nan"),
        (["--clip-grad-norm", "inf"], "--clip-grad-norm must be a finite number > 0, got inf"),
        (["--lora-alpha", "nan"], "--lora-alpha must be a finite number > 0, got nan"),
        (
            ["--comm-timeout", "nan"],
            "--comm-timeout must be a finite positive number of seconds, got nan",
        ),
    ],
)
def test_bad_optimizer_values_are_one_sentence(tmp_path, args: list[str], fragment: str) -> None:
    result = runner.invoke(app, ["train", *args, "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], (
        result.output
    )
    assert not (tmp_path / "run").exists()


def test_help_states_the_defaults_and_the_no_decay_rule() -> None:
    text = " ".join(runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "default 0.1" in text and "1-D parameters (norms, biases) get none" in text
    assert "default 0.9,0.95" in text and "default 1e-8" in text
