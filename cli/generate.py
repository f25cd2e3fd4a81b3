"""`tierzero generate`: new text from a run's checkpoint or a model directory, through the tiers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from tierzero.cli.output import Output

from tierzero.errors import ConfigError
from tierzero.run.prompts import Framing, Prompt, read_prompts

if TYPE_CHECKING:  # imported where it runs: it loads the engine
    from tierzero.run.inference import Inference

# the options of `tierzero generate`, each declared once with its help text
RunDir = Annotated[
    Path | None,
    typer.Option(
        "--run-dir",
        help="A run directory `tierzero train` wrote: its newest intact checkpoint and its "
        "config.toml's model (LoRA adapters included).",
    ),
]
Model = Annotated[
    str | None,
    typer.Option(
        "--model", help="hf:DIR, a local Hugging Face causal LM directory, from its safetensors."
    ),
]
PromptTexts = Annotated[
    list[str] | None,
    typer.Option("--prompt", help="A prompt; repeat for several, generated together in one batch."),
]
PromptsFile = Annotated[
    Path | None,
    typer.Option(
        "--prompts",
        help="A file of prompts: text, one per line, or .jsonl records with a prompt string or "
        "chat messages.",
    ),
]
MaxNewTokens = Annotated[
    int,
    typer.Option(
        "--max-new-tokens",
        help="New tokens per prompt at most (a prompt stops early at the model's end-of-sequence "
        "id).",
    ),
]
Temperature = Annotated[
    float,
    typer.Option(
        "--temperature",
        help="0 (default): greedy, the most likely token; above 0: sample from the softmax of the "
        "logits over it.",
    ),
]
TopP = Annotated[
    float,
    typer.Option(
        "--top-p",
        help="With --temperature: sample from the smallest set of tokens whose probability "
        "reaches this (1: all).",
    ),
]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the sampling draws.")]
Chat = Annotated[
    bool | None,
    typer.Option(
        "--chat/--no-chat",
        help="Render plain prompts as a user's turn with the model's chat template. Default: on "
        "when the run trained on chat records.",
    ),
]
Offload = Annotated[
    str,
    typer.Option(
        "--offload",
        help="Where the weights live: auto (the planner holds them in memory where the budgets "
        "allow, else on NVMe), host, or nvme (every unit read from the store for every new "
        "token).",
    ),
]
Dtype = Annotated[
    str | None,
    typer.Option("--dtype", help="Compute dtype: fp32, bf16 or fp16. Default: the run's own."),
]
Device = Annotated[
    str | None,
    typer.Option(
        "--device", help="Compute device, e.g. cpu or cuda:0. Default: a GPU if there is one."
    ),
]
HostBudget = Annotated[
    str | None, typer.Option("--host-budget", help="Host memory budget, e.g. 8GiB.")
]
GpuBudget = Annotated[
    str | None, typer.Option("--gpu-budget", help="GPU memory budget, e.g. 20GiB.")
]
NvmePath = Annotated[
    Path | None,
    typer.Option(
        "--nvme-path",
        help="Where a temporary store for NVMe-homed weights is made (and removed after). "
        "Default: the run directory, or the system's temp directory.",
    ),
]
JsonOut = Annotated[
    bool,
    typer.Option(
        "--json", help="Print one JSON object: each prompt's ids, the new ids and their text."
    ),
]


def generate(
    run_dir: RunDir = None,
    model: Model = None,
    prompt: PromptTexts = None,
    prompts: PromptsFile = None,
    max_new_tokens: MaxNewTokens = 64,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    seed: Seed = 0,
    chat: Chat = None,
    offload: Offload = "auto",
    dtype: Dtype = None,
    device: Device = None,
    host_budget: HostBudget = None,
    gpu_budget: GpuBudget = None,
    nvme_path: NvmePath = None,
    json_out: JsonOut = False,
) -> None:
    """Generate from the weights as they are tiered: every unit streams through the same tiers
    as in training, once per new token for all prompts at once, with a KV cache per unit on the
    compute device. Greedy unless --temperature is given."""
    from tierzero.run.generate import Sampling
    from tierzero.run.generate import generate as run_generate
    from tierzero.run.inference import open_inference

    sampling = Sampling(max_new_tokens, temperature, top_p, seed)
    given = _prompts(prompt or [], prompts)
    out = Output(json_out)
    engine = dict(
        offload=offload,
        dtype=dtype,
        device=device,
        host_budget=host_budget,
        gpu_budget=gpu_budget,
    )
    with open_inference(model, run_dir, engine, nvme_path) as inference:
        for note in inference.notes:
            out.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
        codec = inference.codec
        ids = [codec.encode(p, _framing(inference.framing, chat)) for p in given]
        new = run_generate(inference.decoder, ids, sampling, codec.stop_ids)
    generations = [
        {"prompt": p.shown(), "prompt_ids": i, "new_ids": n, "text": codec.decode(n)}
        for p, i, n in zip(given, ids, new)
    ]
    if json_out:
        out.emit_json(
            {
                "model": inference.model,
                "step": inference.step,
                "temperature": temperature,
                "top_p": top_p,
                "seed": seed,
                "kv_cache_bytes": inference.decoder.cache_nbytes,
                "generations": generations,
            }
        )
    else:
        _print_generations(out, inference, generations)


def _prompts(texts: list[str], path: Path | None) -> list[Prompt]:
    """The --prompt texts, then the --prompts file's; refused before the weights are loaded."""
    if any(not text for text in texts):
        raise ConfigError("a --prompt is empty; give every prompt some text")
    given = [Prompt(text) for text in texts] + (read_prompts(path) if path is not None else [])
    if not given:
        raise ConfigError("no prompt was given; pass --prompt TEXT or --prompts FILE")
    return given


def _print_generations(
    out: Output, inference: Inference, generations: list[dict[str, Any]]
) -> None:
    """Where the weights came from, then each prompt and what followed it."""
    source = (
        f"checkpoint step {inference.step}" if inference.step is not None else "its own weights"
    )
    kv = inference.decoder.cache_nbytes / 1e6
    out.print(
        f"[bold]tierzero generate[/] {escape(inference.model)} from {source} "
        f"(KV cache {kv:,.1f} MB)",
        highlight=False,
    )
    for g in generations:
        out.print(f"[bold]>[/] {escape(g['prompt'])}", highlight=False)
        out.print(escape(g["text"]), highlight=False)


def _framing(trained: Framing, chat: bool | None) -> Framing:
    """How plain prompts are framed: as the run trained (`--chat`/`--no-chat` unset), or as a
    user's turn in the chat template, or not."""
    if chat is None:
        return trained
    if chat:
        return Framing.CHAT
    return Framing.TEXT if trained is Framing.CHAT else trained
