"""`tierzero plan --model hf:DIR`: the directory's model is planned from its
config.json -- built on `meta`, partitioned as the engine partitions it -- not refused as an
unknown preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")

from tierzero.cli.app import app  # noqa: E402

from tierzero.hf import load_model  # noqa: E402
from tierzero.layout.partition import partition  # noqa: E402

MACHINE = ["--host-mem", "8GB", "--gpu-mem", "4GB", "--nvme-free", "1TB"]


def plan(*args: str) -> str:
    result = CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("arch, gpus", [("llama", 1), ("gpt2", 2)])
def test_plan_reads_an_hf_directory(hf_models: dict[str, Path], arch: str, gpus: int) -> None:
    name = f"hf:{hf_models[arch]}"
    report = json.loads(plan("--model", name, "--gpus", str(gpus), *MACHINE, "--json"))
    built = load_model(name).model
    units = partition(built, gpus)
    assert report["model"]["preset"] == name
    assert report["model"]["params"] == sum(p.numel() for p in built.parameters())
    assert report["model"]["units"] == len(units)
    assert report["model"]["largest_unit_params"] == max(u.numel for u in units)
    assert report["verdict"]["fits"]
    # kept graphs: estimated from the LLaMA-like shape here, measured by the engine
    rc = report["recompute"]
    assert rc["sized_by"] == "the engine's first step" and rc["kept_blocks"] == len(units) - 2
    text = plan("--model", name, "--gpus", str(gpus), *MACHINE)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "unknown model preset" not in text
    assert "the engine measures each unit's at its first step" in " ".join(text.split())


def test_hf_plans_refuse_preset_shape_flags(hf_models: dict[str, Path]) -> None:
    result = CliRunner().invoke(
        app, ["plan", "--model", f"hf:{hf_models['llama']}", "--vocab-size", "512", *MACHINE]
    )
    assert result.exit_code != 0
    assert "drop --params and --vocab-size" in str(result.exception) + result.output


def test_hf_plans_print_both_schedules_and_auto_runs_vertically(tmp_path: Path) -> None:
    """A 134M LLaMA directory (config only: the plan reads nothing else) that needs NVMe: with
    --accumulate 4 auto plans vertically, and both schedules' NVMe bytes are printed."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        vocab_size=32000,
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path / "m")
    args = [
        "--model",
        f"hf:{tmp_path / 'm'}",
        "--gpu-mem",
        "1GB",
        "--host-mem",
        "1GB",
        "--nvme-free",
        "1TB",
        "--seq-len",
        "64",
        "--accumulate",
        "4",
    ]
    schedule = json.loads(plan(*args, "--json"))["schedule"]
    moved = schedule["nvme_bytes_per_step"]
    assert schedule["schedule"] == "vertical" and 0 < moved["vertical"] < moved["horizontal"]
    horizontal = json.loads(plan(*args, "--schedule", "horizontal", "--json"))["schedule"]
    assert horizontal["schedule"] == "horizontal" and horizontal["nvme_bytes_per_step"] == moved
    assert "Schedule: vertical, 4 micro-batch(es) per step" in plan(*args)


def test_hf_plans_keep_a_model_the_engine_runs_horizontally_horizontal(tmp_path: Path) -> None:
    """OLMo's final norm has no parameters (the engine keeps it horizontal): auto plans it so,
    and --schedule vertical is refused in one sentence naming why."""
    from transformers import OlmoConfig

    OlmoConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=256,
    ).save_pretrained(tmp_path / "olmo")
    args = ["--model", f"hf:{tmp_path / 'olmo'}", *MACHINE, "--seq-len", "64", "--accumulate", "4"]
    assert json.loads(plan(*args, "--json"))["schedule"]["schedule"] == "horizontal"
    result = CliRunner().invoke(app, ["plan", *args, "--schedule", "vertical"])
    assert result.exit_code != 0
    assert "final norm has no parameters" in str(result.exception) + result.output


def test_python_plans_an_hf_directory_as_the_cli_does(hf_models: dict[str, Path]) -> None:
    """`tierzero.plan("hf:DIR")` builds the model from its config as `tierzero plan` does: the
    same report, printed by the CLI as JSON."""
    import tierzero

    name = f"hf:{hf_models['llama']}"
    report = tierzero.plan(name, host_mem="8GB", gpu_mem="4GB", nvme_free="1TB", accumulate=4)
    cli = json.loads(plan("--model", name, *MACHINE, "--accumulate", "4", "--json"))
    assert json.loads(json.dumps(report.as_dict())) == cli
    assert report.as_dict()["model"]["units"] == len(partition(load_model(name).model, 1))


def test_python_plans_lora_on_an_nf4_base_as_the_cli_does(hf_models: dict[str, Path]) -> None:
    """`tierzero.plan(..., lora=LoraSpec(...), quantize_base="nf4")` is `tierzero plan --lora-r
    --quantize-base nf4`: adapters on q_proj and v_proj, the base's other linear weights coded."""
    import tierzero
    from tierzero.hf.lora import LoraSpec

    name = f"hf:{hf_models['llama']}"
    lora = LoraSpec(8, 8.0, 0.0, ("q_proj", "v_proj"))
    machine = dict(host_mem="8GB", gpu_mem="4GB", nvme_free="1TB")
    report = tierzero.plan(name, lora=lora, quantize_base="nf4", **machine)
    lora_flags = ["--lora-r", "8", "--lora-targets", "q_proj,v_proj"]
    cli = json.loads(
        plan("--model", name, *MACHINE, *lora_flags, "--quantize-base", "nf4", "--json")
    )
    assert json.loads(json.dumps(report.as_dict())) == cli
    assert cli["base"]["quantize_base"] == "nf4" and report.placement.param.value != "gpu"
