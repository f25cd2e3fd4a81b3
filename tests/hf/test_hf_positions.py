"""`--seq-len` against a Hugging Face model's positions (`tierzero.hf.positions`): refused in one
sentence where transformers' own forward fails past them (MPT's ALiBi bias of `max_seq_len`,
GPT-J's rotary table), said once where rotary embeddings run on (LLaMA at 4x its
`max_position_embeddings`), and nothing where positions have no limit (Bloom's and Falcon's
ALiBi)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tierzero.cli.app import app
from typer.testing import CliRunner

from tests.support.cli import one_line_error
from tierzero.hf import load_model

runner = CliRunner()
POSITIONS = 32
QUICK = ["--steps", "1", "--batch-size", "1", "--offload", "nvme", "--dtype", "fp32"]


def save(kind: str, path: Path) -> Path:
    from transformers import AutoModelForCausalLM, BloomConfig, FalconConfig, GPTJConfig, MptConfig

    config = {
        "mpt": lambda: MptConfig(
            d_model=32, n_layers=2, n_heads=2, vocab_size=256, max_seq_len=POSITIONS
        ),
        "gptj": lambda: GPTJConfig(
            n_embd=32,
            n_layer=2,
            n_head=2,
            vocab_size=256,
            n_positions=POSITIONS,
            rotary_dim=8,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "bloom": lambda: BloomConfig(hidden_size=32, n_layer=2, n_head=2, vocab_size=256),
        "falcon": lambda: FalconConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            vocab_size=256,
            alibi=True,
            max_position_embeddings=POSITIONS,
            bos_token_id=0,
            eos_token_id=0,
        ),
    }[kind]()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def own_forward(path: Path, seq_len: int) -> None:
    """transformers' own model, as saved, on one sequence of `seq_len` tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        model(input_ids=torch.zeros(1, seq_len, dtype=torch.long))


@pytest.mark.parametrize("kind, key", [("mpt", "max_seq_len"), ("gptj", "max_position_embeddings")])
def test_seq_len_past_positions_the_model_cannot_run_is_refused(
    kind: str, key: str, tmp_path: Path
) -> None:
    path = save(kind, tmp_path / kind)
    own_forward(path, POSITIONS)
    with pytest.raises((RuntimeError, IndexError)):  # what a run at POSITIONS + 1 died of
        own_forward(path, POSITIONS + 1)
    line = one_line_error(
        runner.invoke(
            app,
            [
                "train",
                "--model",
                f"hf:{path}",
                *QUICK,
                "--seq-len",
                str(POSITIONS + 1),
                "--run-dir",
                str(tmp_path / "run"),
            ],
        )
    )
    assert (
        f"--seq-len {POSITIONS + 1} is longer than" in line
        and f"({POSITIONS} positions, {key})" in line
    )
    assert f"use --seq-len {POSITIONS} or less" in line
    ok = runner.invoke(
        app,
        [
            "train",
            "--model",
            f"hf:{path}",
            *QUICK,
            "--seq-len",
            str(POSITIONS),
            "--run-dir",
            str(tmp_path / "ok"),
        ],
    )
    assert ok.exit_code == 0, ok.output


def test_rotary_model_past_its_positions_trains_and_says_so_once(hf_models, tmp_path: Path) -> None:
    """The test LLaMA has max_position_embeddings 128: at 512 it runs, and the run says so once."""
    result = runner.invoke(
        app,
        [
            "train",
            "--model",
            f"hf:{hf_models['llama']}",
            *QUICK,
            "--seq-len",
            "512",
            "--run-dir",
            str(tmp_path / "run"),
        ],
    )
    assert result.exit_code == 0, result.output
    said = [
        line
        for line in result.output.splitlines()
        if "--seq-len 512 is 4x the 128 positions" in line
    ]
    assert (
        len(said) == 1 and said[0].startswith("note:") and "max_position_embeddings" in said[0]
    ), result.output
    assert load_model(hf_models["llama"]).check_seq_len(128) is None


# ALiBi computed per call (Falcon's rotary module unused)
@pytest.mark.parametrize("kind", ["bloom", "falcon"])
def test_positions_without_a_limit_are_not_checked(kind: str, tmp_path: Path) -> None:
    path = save(kind, tmp_path / kind)
    own_forward(path, 4 * POSITIONS)
    assert load_model(path).check_seq_len(1 << 20) is None
