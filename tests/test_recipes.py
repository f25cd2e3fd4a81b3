"""recipes/*.toml: each loads as a `--config` file, says in its header the machine it is for
and the command that runs it, and fits that machine by `tierzero.plan`: the compute tier
within the GPU (90% of it, as `tierzero train` takes), host memory within the recipe's host
budget (or train's default, half the RAM) and that within the RAM, the NVMe state and the
checkpoints kept within the disk.

A recipe for a Hugging Face model is planned on a config-only directory of the shape it names
(no weights: the plan reads config.json alone), with its LoRA adapters added as the run adds
them, so the frozen base and the trained adapters are counted apart."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tierzero.config import RunConfig, Tier, parse_bytes
from tierzero.configfile import load_run_config
from tierzero.hf.build import load_model
from tierzero.hf.lora import LoraSpec, add_lora
from tierzero.hf.plan import hf_workload
from tierzero.layout.partition import partition
from tierzero.planning.placement import Link
from tierzero.planning.planreport import PlanReport, make_plan
from tierzero.planning.wear import checkpoint_nbytes

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
HOST_SHARE = (
    0.75  # a host budget leaves a quarter of the RAM to the OS, CUDA and the process itself
)


def llama_7b() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    )


def llama_13b() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=32000,
        max_position_embeddings=4096,
    )


def llama3_405b() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )


def llama3_70b() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )


def olmoe_1b_7b() -> Any:
    from transformers import OlmoeConfig

    return OlmoeConfig(
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=50304,
        num_experts=64,
        num_experts_per_tok=8,
        max_position_embeddings=4096,
    )


# what each recipe is planned as: a Hugging Face config (the model its command names) or a
# preset shape (for the full fine-tune, Llama-2-7B's: the `7b` preset), or None for the
# model the recipe itself names
SHAPES: dict[str, Callable[[], Any] | str | None] = {
    "lora-7b-chat.toml": llama_7b,
    "full-7b-compact.toml": "7b",
    "lora-13b.toml": llama_13b,
    "pretrain-1b.toml": None,
    "lora-moe.toml": olmoe_1b_7b,
    "llama3-405b-lora.toml": llama3_405b,
    "llama3-70b-qlora.toml": llama3_70b,
}


def header(path: Path) -> tuple[dict[str, int], str]:
    """The recipe's `# machine: gpu 24GB, ram 64GB, nvme 200GB` in bytes, and its command."""
    text = path.read_text()
    machine = re.search(r"^# machine: (.+)$", text, re.MULTILINE)
    command = re.search(r"^# command: (.+)$", text, re.MULTILINE)
    assert machine and command, f"{path.name} has no '# machine:' or '# command:' line"
    sizes = dict(part.split() for part in machine.group(1).split(", "))
    assert set(sizes) == {"gpu", "ram", "nvme"}, sizes
    return {k: parse_bytes(v, k) for k, v in sizes.items()}, command.group(1)


def test_every_recipe_is_planned_here() -> None:
    assert sorted(p.name for p in RECIPES.glob("*.toml")) == sorted(SHAPES)


def plan_recipe(name: str, run: RunConfig, machine: dict[str, int], tmp: Path) -> PlanReport:
    """`tierzero.plan` of the run `name` configures on `machine`, as `tierzero train` sizes it."""
    cfg, shape = run.engine, SHAPES[name]
    clipped = cfg.optimizer.clip_grad_norm is not None
    kw: dict[str, Any] = {
        "gpu_mem": cfg.tiering.gpu_budget or int(0.9 * machine["gpu"]),
        "host_mem": cfg.tiering.host_budget or machine["ram"] // 2,
        "nvme_free": machine["nvme"],
        "dtype": cfg.precision.dtype.value,
        "batch_size": run.batch_size,
        "seq_len": run.seq_len,
        "accumulate": cfg.execution.accumulate,
        "schedule": cfg.execution.schedule.value,
        "recompute": cfg.execution.recompute.value,
        "optimizer_state": cfg.formats.optimizer_state.value,
        "master": cfg.formats.master.value,
        "quantize_base": cfg.formats.quantize_base,
        "steps": run.steps,
        "checkpoint_every": run.checkpoints.checkpoint_every,
        "overlap": cfg.execution.overlap_step
        if cfg.execution.overlap_step is not None
        else not clipped,
    }  # as the engine decides it
    if shape is None or isinstance(shape, str):
        assert run.lora.lora_r is None, "LoRA adapts a Hugging Face model"
        return make_plan(shape or run.model, **kw)
    directory = tmp / name.removesuffix(".toml")
    shape().save_pretrained(directory)
    model = f"hf:{directory}"
    built = hf_workload(model, 1)
    if (
        run.lora.lora_r is not None
    ):  # the adapters as the run adds them: the base frozen, the adapters trained
        spec = LoraSpec(
            run.lora.lora_r,
            run.lora.lora_alpha,
            run.lora.lora_dropout,
            tuple(run.lora.lora_targets or ()) or None,
        )
        built["units"] = partition(add_lora(load_model(model), spec, None), 1)
    return make_plan(model, **built, **kw)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_recipe_fits_the_machine_it_names(name: str, tmp_path: Path) -> None:
    path = RECIPES / name
    machine, command = header(path)
    assert command.startswith(f"tierzero train --config recipes/{name}")
    assert ("--model" in command) == (SHAPES[name] is not None), (
        "a recipe names its model, or its command does"
    )
    run = load_run_config(path)
    assert run.engine.tiering.gpu_budget is None or run.engine.tiering.gpu_budget <= machine["gpu"]
    assert (
        run.engine.tiering.host_budget is None
        or run.engine.tiering.host_budget <= HOST_SHARE * machine["ram"]
    )
    report = plan_recipe(name, run, machine, tmp_path)
    assert report.choice.fits, report.choice.shortfall
    resident, budgets = report.choice.resident_bytes, report.budgets
    assert (
        resident[Tier.GPU] <= budgets[Tier.GPU] <= machine["gpu"]
    )  # the compute tier within the GPU
    assert resident[Tier.HOST] <= budgets[Tier.HOST] <= machine["ram"]  # host memory within the RAM
    kept = run.checkpoints.keep_checkpoints * checkpoint_nbytes(report.workload, report.placement)
    assert resident[Tier.NVME] + kept <= machine["nvme"]  # the NVMe state and the checkpoints kept
    if run.lora.lora_r is not None:
        trained = sum(min(u.numel, u.trainable_numel) for u in report.units)
        assert trained < 0.01 * report.numel  # the base is frozen: only the adapters have state


def test_the_qlora_recipes_store_the_base_in_nf4(tmp_path: Path) -> None:
    """70B: the NF4 base (42.7 GB, 0.61 B/param with its bf16 embedding and head) is homed in
    host memory, so no step reads or writes the drive; 405B: it streams from the one NVMe at
    0.58 B/param, under a third of the bf16 base's reads a step."""
    plans = {}
    for name in ("llama3-70b-qlora.toml", "llama3-405b-lora.toml"):
        machine, _ = header(RECIPES / name)
        plans[name] = plan_recipe(name, load_run_config(RECIPES / name), machine, tmp_path)
    seventy, big = plans.values()
    for report in plans.values():
        base = report.as_dict()["base"]
        assert base["quantize_base"] == "nf4" and 0.55 < base["bytes_per_param"] < 0.62, base
        assert base["stored_bytes"] < 0.31 * base["compute_dtype_bytes"], base
    assert seventy.placement.param is Tier.HOST
    assert seventy.choice.estimate.moved_bytes[Link.NVME_TO_HOST] == 0
    assert seventy.step_nvme_bytes()["horizontal"] == 0 and not seventy.vertical
    assert big.placement.param is Tier.NVME and big.vertical
    reads = big.choice.estimate.moved_bytes[Link.NVME_TO_HOST]
    assert reads == 2 * big.as_dict()["base"]["stored_bytes"]  # forward and recompute
    bf16_reads = 2 * big.as_dict()["base"]["compute_dtype_bytes"]
    assert reads < 0.3 * bf16_reads


def tiny_llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    )


def tiny_olmoe() -> Any:
    from transformers import OlmoeConfig

    return OlmoeConfig(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )


# the same family at a size this machine trains in seconds: the recipe's keys, LoRA targets and
# schedule go through `tierzero train` as written, only the size flags (and a host budget this
# machine has) overridden
STAND_INS: dict[str, Callable[[], Any] | str] = {
    "lora-7b-chat.toml": tiny_llama,
    "full-7b-compact.toml": tiny_llama,
    "lora-13b.toml": tiny_llama,
    "pretrain-1b.toml": "tiny",
    "lora-moe.toml": tiny_olmoe,
    "llama3-405b-lora.toml": tiny_llama,
    "llama3-70b-qlora.toml": tiny_llama,
}


@pytest.mark.parametrize("name", sorted(STAND_INS))
def test_a_recipe_trains_through_the_cli(name: str, tmp_path: Path) -> None:
    import json

    from tierzero.cli.app import app
    from typer.testing import CliRunner

    stand_in = STAND_INS[name]
    if isinstance(stand_in, str):
        model = stand_in
    else:
        stand_in().save_pretrained(tmp_path / "model")
        model = f"hf:{tmp_path / 'model'}"
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"recipe line {i} " * 6}) + "\n" for i in range(32))
    )
    # an NF4 base is stored off the GPU, and a stand-in this small fits on it: name the drive
    coded = load_run_config(RECIPES / name).engine.formats.quantize_base != "none"
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--config",
            str(RECIPES / name),
            "--model",
            model,
            "--data",
            str(data),
            "--steps",
            "2",
            "--batch-size",
            "1",
            "--seq-len",
            "16",
            "--accumulate",
            "2",
            "--eval-tokens",
            "64",
            "--host-budget",
            "2GB",
            "--offload",
            "nvme" if coded else "auto",
            "--run-dir",
            str(tmp_path / "run"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    assert summary["steps"] == 2 and summary["drive_wear"]["steps"] == 2
    written = (tmp_path / "run" / "config.toml").read_text()
    run = load_run_config(RECIPES / name)
    assert f'dtype = "{run.engine.precision.dtype.value}"' in written
    assert ("lora_r = " in written) == (run.lora.lora_r is not None)
