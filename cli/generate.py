"""`tierzero generate`: new text from a run's checkpoint or a model directory, through the tiers."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from tierzero.cli.output import Output

from tierzero.errors import ConfigError
from tierzero.run.prompts import Framing, Prompt, read_prompts


def generate(
    run_dir: Path | None = typer.Option(
        None,
        "--run-dir",
        help="A run directory `tierzero train` wrote: its newest intact checkpoint and its "
        "config.toml's model (LoRA adapters included).",
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        help="hf:DIR, a local Hugging Face causal LM directory, from its safetensors.",
    ),
    prompt: list[str] | None = typer.Option(
        None,
        "--prompt",
        help="A prompt; repeat for several, generated together in one batch.",
    ),
    prompts: Path | None = typer.Option(
        None,
        "--prompts",
        help="A file of prompts: text, one per line, or .jsonl records with a prompt string or "
        "chat messages.",
    ),
    max_new_tokens: int = typer.Option(
        64,
        "--max-new-tokens",
        help="New tokens per prompt at most (a prompt stops early at the model's "
        "end-of-sequence id).",
    ),
    temperature: float = typer.Option(
        0.0,
        "--temperature",
        help="0 (default): greedy, the most likely token; above 0: sample from the softmax of "
        "the logits over it.",
    ),
    top_p: float = typer.Option(
        1.0,
        "--top-p",
        help="With --temperature: sample from the smallest set of tokens whose probability "
        "reaches this (1: all).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling draws."),
    chat: bool | None = typer.Option(
        None,
        "--chat/--no-chat",
        help="Render plain prompts as a user's turn with the model's chat template. Default: on "
        "when the run trained on chat records.",
    ),
    offload: str = typer.Option(
        "auto",
        "--offload",
        help="Where the weights live: auto (the planner holds them in memory where the budgets "
        "allow, else on NVMe), host, or nvme (every unit read from the store for every new token).",
    ),
    dtype: str | None = typer.Option(
        None,
        "--dtype",
        help="Compute dtype: fp32, bf16 or fp16. Default: the run's own.",
    ),
    device: str | None = typer.Option(
        None,
        "--device",
        help="Compute device, e.g. cpu or cuda:0. Default: a GPU if there is one.",
    ),
    host_budget: str | None = typer.Option(
        None, "--host-budget", help="Host memory budget, e.g. 8GiB."
    ),
    gpu_budget: str | None = typer.Option(
        None, "--gpu-budget", help="GPU memory budget, e.g. 20GiB."
    ),
    nvme_path: Path | None = typer.Option(
        None,
        "--nvme-path",
        help="Where a temporary store for NVMe-homed weights is made (and removed after). "
        "Default: the run directory, or the system's temp directory.",
    ),
    json_out: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON object: each prompt's ids, the new ids and their text.",
    ),
) -> None:
    """Generate from the weights as they are tiered: every unit streams through the same tiers
    as in training, once per new token for all prompts at once, with a KV cache per unit on the
    compute device. Greedy unless --temperature is given."""
    from tierzero.run.generate import Sampling
    from tierzero.run.generate import generate as run_generate
    from tierzero.run.inference import open_inference

    sampling = Sampling(max_new_tokens, temperature, top_p, seed)
    if any(not p for p in prompt or []):  # before the weights are loaded
        raise ConfigError("a --prompt is empty; give every prompt some text")
    given = [Prompt(p) for p in prompt or []] + (
        read_prompts(prompts) if prompts is not None else []
    )
    if not given:
        raise ConfigError("no prompt was given; pass --prompt TEXT or --prompts FILE")
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
        return
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
