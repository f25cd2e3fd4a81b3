"""What a first Hugging Face run trips on, each one sentence and the right exit code: --seq-len
past a learned position table (GPT-2's wpe) and an encoder (BERT-style, bidirectional attention)
are refused before training; `export --out out/x` creates the directory; the export of an hf:
run carries the tokenizer files of the directory it started from."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tierzero.cli.app import app
from typer.testing import CliRunner

runner = CliRunner()
QUICK = [
    "--steps",
    "2",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--offload",
    "nvme",
    "--dtype",
    "fp32",
]


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output
    ), result.output
    return lines[0]


def test_seq_len_past_a_learned_position_table_is_refused(hf_models, tmp_path) -> None:
    line = one_line_error(
        runner.invoke(
            app,
            [
                "train",
                "--model",
                f"hf:{hf_models['gpt2']}",
                *QUICK,
                "--seq-len",
                "129",
                "--run-dir",
                str(tmp_path / "run"),
            ],
        )
    )
    assert (
        "--seq-len 129 is longer than" in line
        and "(128 positions" in line
        and "use --seq-len 128 or less" in line
    )
    ok = runner.invoke(
        app,
        [
            "train",
            "--model",
            f"hf:{hf_models['gpt2']}",
            *QUICK[:-4],
            "--seq-len",
            "128",
            "--offload",
            "nvme",
            "--run-dir",
            str(tmp_path / "ok"),
        ],
    )
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize("is_decoder", [False, True])
def test_an_encoder_is_refused_and_a_causal_bert_trains(tmp_path, is_decoder: bool) -> None:
    from transformers import AutoModelForCausalLM, BertConfig

    config = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=256,
        max_position_embeddings=64,
        is_decoder=is_decoder,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "bert")
    result = runner.invoke(
        app,
        ["train", "--model", f"hf:{tmp_path / 'bert'}", *QUICK, "--run-dir", str(tmp_path / "run")],
    )
    if is_decoder:
        assert result.exit_code == 0, result.output
    else:
        line = one_line_error(result)
        assert (
            "whose attention is bidirectional (an encoder)" in line
            and "pass a decoder model directory" in line
        )


def test_export_creates_its_directory_and_copies_the_tokenizer(hf_models, tmp_path) -> None:
    source = Path(shutil.copytree(hf_models["llama"], tmp_path / "llama"))
    (source / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    run_dir = tmp_path / "run"
    result = runner.invoke(
        app, ["train", "--model", f"hf:{source}", *QUICK, "--run-dir", str(run_dir)]
    )
    assert result.exit_code == 0, result.output
    out = tmp_path / "out" / "x"
    result = runner.invoke(app, ["export", str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert not (out / "special_tokens_map.json").exists()  # only what the source has
    assert not [f for f in out.iterdir() if f.name.startswith(".")]  # no temp file left
