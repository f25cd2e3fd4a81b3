"""The CLI speaks in its own words (typer's runner): a refused value is named by the flag the
user typed (`--steps`, not the `total_steps` it sets) or by the key of their --config file; a
refusal from the first step stands alone, after no "step 0/N loss nan 0 tok/s"; and what the
user named -- a model directory, a run directory, an output path -- prints as it is, never as
rich markup or an emoji (`hf:llama:` is not a llama)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tierzero.cli.app import app
from typer.testing import CliRunner

from tests.support.cli import one_line_error, train
from tierzero.errors import ConfigError

runner = CliRunner()
MARKUP = (
    ":rocket:[red]x:llama:"  # an emoji code, a markup tag and another emoji (no "/": a file name)
)


@pytest.mark.parametrize(
    "args, said",
    [
        (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
        (["--accumulate", "0"], "--accumulate must be an integer >= 1, got 0"),
        (["--adam-betas", "0.9,1.5"], "--adam-betas must be two numbers in [0, 1)"),
        (["--warmup-steps", "-1"], "--warmup-steps must be a finite number >= 0, got -1"),
    ],
)
def test_a_refused_flag_is_named_as_typed(tmp_path: Path, args: list[str], said: str) -> None:
    line = one_line_error(train(*args, "--run-dir", str(tmp_path / "run")))
    assert line.startswith(f"error: {said}"), line
    assert not any(
        key in line
        for key in ("total_steps", "batch_size", "warmup_steps", " betas ", "error: accumulate")
    )


def test_a_refused_config_file_value_is_named_by_its_key(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("total_steps = 0\n")
    line = one_line_error(
        train("--config", str(config), "--steps", "3", "--run-dir", str(tmp_path / "run"))
    )
    assert line.startswith("error: total_steps must be a finite number > 0, got 0"), line


def test_a_model_without_repeated_blocks_is_told_the_flag(tmp_path: Path) -> None:
    from tests.support.hf import save_model

    path = save_model("llama", tmp_path / "one-layer", num_hidden_layers=1)
    line = one_line_error(train("--model", f"hf:{path}", "--run-dir", str(tmp_path / "run")))
    assert (
        "LlamaForCausalLM has no nn.ModuleList of repeated blocks" in line
        and "with --units" in line
    ), line


def test_a_refusal_in_the_first_step_prints_no_progress_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self, batch, **_):
        raise ConfigError("this step cannot run; change the thing that stops it")

    monkeypatch.setattr("tierzero.engine.Engine.train_micro_batch", refuse)
    result = train("--steps", "2", "--dtype", "fp32", "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1] == "error: this step cannot run; change the thing that stops it", result.output
    assert not any("step 0/" in line or "loss nan" in line or "tok/s" in line for line in lines), (
        result.output
    )


def test_names_print_as_given_not_as_markup_or_emoji(hf_models, tmp_path: Path) -> None:
    model = tmp_path / f"model{MARKUP}"
    os.symlink(hf_models["llama"], model)
    planned = runner.invoke(
        app, ["plan", "--model", f"hf:{model}", "--nvme-free", "1TB"], env={"COLUMNS": "400"}
    )
    assert planned.exit_code == 0, planned.output
    assert f"tierzero plan hf:{model}: " in planned.output

    run_dir = tmp_path / f"run{MARKUP}"
    trained = train("--steps", "1", "--dtype", "fp32", "--run-dir", str(run_dir))
    assert trained.exit_code == 0, trained.output
    assert f"metrics in {run_dir}/metrics.jsonl" in trained.output
    out = tmp_path / f"out{MARKUP}" / "w.safetensors"
    out.parent.mkdir()
    exported = runner.invoke(app, ["export", str(run_dir), "--out", str(out)])
    assert exported.exit_code == 0 and f"to {out}" in exported.output, exported.output
    inspected = runner.invoke(app, ["inspect", str(run_dir)], env={"COLUMNS": "400"})
    assert inspected.exit_code == 0 and f"checkpoints of {run_dir}" in inspected.output, (
        inspected.output
    )
    assert f"{run_dir}/nvme" in inspected.output  # the config's nvme_path and the stores' caption
    reported = runner.invoke(app, ["report", str(run_dir)], env={"COLUMNS": "400"})
    assert reported.exit_code == 0 and f"run {run_dir}" in reported.output, reported.output
    assert f"plot: {run_dir}/report.png" in reported.output
    missing = one_line_error(runner.invoke(app, ["inspect", str(tmp_path / f"gone{MARKUP}")]))
    assert f"gone{MARKUP}" in missing
    for result in (planned, trained, exported, inspected, reported):
        # no rocket, no llama
        assert "\U0001f680" not in result.output and "\U0001f999" not in result.output
