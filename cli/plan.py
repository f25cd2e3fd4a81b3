"""`tierzero plan`: the memory ledger of a model on a machine, and where its state should live."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich import box
from rich.table import Table

from tierzero.cli.output import Output
from tierzero.config import Config, StateKind, Tier
from tierzero.planning.ledger import GB
from tierzero.models.presets import PRESETS
from tierzero.planning.placement import Link
from tierzero.planning.report import DEFAULT_PRESET, make_plan


def plan(
    model: Optional[str] = typer.Option(None, "--model", help=f"Model preset: {', '.join(PRESETS)} (default {DEFAULT_PRESET})."),
    params: Optional[str] = typer.Option(None, "--params", help="A parameter count instead of a preset, e.g. 7e9 or 70B; shaped like the nearest preset."),
    gpus: int = typer.Option(1, "--gpus", help="Data-parallel GPUs (ranks), all on this machine."),
    gpu_mem: Optional[str] = typer.Option(None, "--gpu-mem", help="Memory per GPU, e.g. 80GB or 24GiB. Default: GPU 0's; without CUDA, half of RAM split across ranks."),
    host_mem: Optional[str] = typer.Option(None, "--host-mem", help="Host memory, e.g. 512GB. Default: this machine's RAM (half of it without CUDA)."),
    nvme_free: Optional[str] = typer.Option(None, "--nvme-free", help="Free NVMe space, e.g. 2TB. Default: free space at --nvme-path."),
    nvme_path: Path = typer.Option(Path("."), "--nvme-path", help="Where offloaded state would go (for the free-space default)."),
    batch_size: int = typer.Option(1, "--batch-size", help="Sequences per micro-batch per GPU (activation memory)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence. Default: the model's max_seq_len."),
    prefetch_depth: int = typer.Option(2, "--prefetch-depth", help="Units fetched ahead of compute."),
    dtype: str = typer.Option("bf16", "--dtype", help="Compute dtype: bf16, fp16 or fp32."),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="Override the shape's vocabulary, e.g. 128256."),
    piece_numel: int = typer.Option(Config.piece_numel, "--piece-numel", help="Elements per piece in which grads and optimizer states stream."),
    overlap: bool = typer.Option(True, "--overlap/--no-overlap", help="Step each unit during backward (the engine's default without clipping or fp16)."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="A `tierzero bench --profile-out` file: predicts step times."),
    stage: Optional[int] = typer.Option(None, "--stage", help="With --gpus > 1, the ZeRO stage (1, 2 or 3); default: chosen as `tierzero train` chooses it (1 or 2 when replicated state fits, else 3)."),
    accumulate: int = typer.Option(1, "--accumulate", help="Micro-batches per step (stage 1 keeps whole grads between them)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Print the 16-byte ledger per GPU (DDP, ZeRO 1-3), the ZeRO stage (--gpus > 1) and its
    offload placements, the activation memory, which placement fits this machine, and its peak
    in every tier, part by part.

    Model shapes: a preset (--model; the LLaMA-3 shapes are llama3-8b and llama3-70b), a
    parameter count shaped like the nearest preset (--params), and --vocab-size to change a
    shape's vocabulary."""
    report = make_plan(model, params=params, gpus=gpus, gpu_mem=gpu_mem, host_mem=host_mem, nvme_free=nvme_free,
                       nvme_path=nvme_path, batch_size=batch_size, seq_len=seq_len, prefetch_depth=prefetch_depth,
                       dtype=dtype, vocab_size=vocab_size, piece_numel=piece_numel, overlap=overlap,
                       profile=profile, stage=stage, accumulate=accumulate).as_dict()
    out = Output(json_out)
    if json_out:
        out.emit_json(report)
        return
    _print_report(out, report)


_LINK_HEADERS = {Link.NVME_TO_HOST: "nvme rd", Link.HOST_TO_NVME: "nvme wr",
                 Link.HOST_TO_GPU: "h2d", Link.GPU_TO_HOST: "d2h"}


def _gb(nbytes: float) -> str:
    gb = nbytes / GB
    return f"{gb:.1f}" if gb < 100 else f"{gb:.0f}"


def _print_report(out: Output, r: dict[str, Any]) -> None:
    m, mach, act = r["model"], r["machine"], r["activations"]
    basis = "nominal size" if m["ledger_params"] != m["params"] else "exact size"
    what = m["preset"] or f"{m['params'] / 1e9:g}B params shaped like {m['shape']}"
    out.print(f"[bold]tierzero plan[/] {what}: {m['params'] / 1e9:.3f}B params in {m['units']} units "
              f"(largest {m['largest_unit_params'] / 1e6:,.1f}M), {mach['gpus']} GPU(s), {r['dtype']}")

    t = Table(title=f"Training state per GPU ({basis}: {m['ledger_params'] / 1e9:g}B params)")
    for col in ("stage", "bytes/param", "GB per GPU", f"GB per GPU (exact {m['params'] / 1e9:.2f}B)"):
        t.add_column(col, justify="right" if col != "stage" else "left")
    for row in r["ledger"]:
        t.add_row(row["stage"], f"{row['bytes_per_param']:g}", f"{row['gb_per_gpu']:g}", f"{row['exact_gb_per_gpu']:.2f}")
    out.print(t)

    out.print(f"Activations per GPU (batch {act['batch_size']} x seq {act['seq_len']}, per-unit checkpointing, "
              f"loss in chunks of {act['chunk_tokens']} tokens): {_gb(act['total_bytes'])} GB = checkpoints "
              f"{_gb(act['checkpoints_bytes'])} + max(block backward {_gb(act['block_backward_bytes'])}, "
              f"head backward {_gb(act['head_backward_bytes'])})")

    budgets = {t.value: mach[f"{t.value}_budget_bytes"] for t in Tier}
    step_col = r["placements"][0]["predicted_step_s"] is not None
    st = r["stage"]
    if mach["gpus"] > 1:
        out.print(f"ZeRO stage {st['stage']} ({st['reason']}): {st['text']}", highlight=False)
    t = Table(title=f"Stage-{st['stage']} placements: GB at peak (gpu per GPU, rest per machine), GB moved per step",
              box=box.SIMPLE_HEAD, padding=(0, 1))
    for col in ("param/grad/opt", "gpu", "host", "nvme", *_LINK_HEADERS.values(), *(["step s"] if step_col else []), "fits"):
        t.add_column(col, justify="left" if col in ("param/grad/opt", "fits") else "right",
                     no_wrap=col in ("param/grad/opt", "fits"))
    for p in r["placements"]:
        homes, res, moved = p["placement"], p["resident_bytes"], p["moved_bytes"]
        over = [tier for tier, b in budgets.items() if b is not None and res[tier] > b]
        t.add_row("/".join(homes[k.value] for k in (StateKind.PARAM, StateKind.GRAD, StateKind.MASTER)),
                  *(_gb(res[tier]) for tier in budgets), *(_gb(moved[link.value]) for link in _LINK_HEADERS),
                  *([f"{p['predicted_step_s']:.2f}"] if step_col else []),
                  "[green]yes[/]" if p["fits"] else f"[red]no ({','.join(over)})[/]")
    out.print(t)

    detected = f" (detected: {', '.join(mach['detected'])})" if mach["detected"] else ""
    out.print("Machine: " + ", ".join(f"{tier} {_gb(b)} GB" for tier, b in budgets.items() if b is not None)
              + detected)
    v = r["verdict"]
    if v["fits"]:
        out.print(f"[bold green]fits:[/] {' '.join(f'{k}={t}' for k, t in v['placement'].items())}")
    else:
        out.print(f"[bold red]does not fit:[/] {v['shortfall']}")
    out.print("Peak per tier, part by part (the phase where each part peaks):", highlight=False)
    for line in v["breakdown"]:
        out.print(f"  {line}", highlight=False)
    rank = r["per_rank"]
    if rank["ranks"] > 1:
        budget = "" if rank["host_budget_bytes"] is None else f" (its host budget: {_gb(rank['host_budget_bytes'])} GB)"
        out.print(f"Per rank, 1 of {rank['ranks']} on this machine{budget}; the ranks share the machine's "
                  "drives, so nvme traffic above is all ranks' on one bandwidth:", highlight=False)
        for line in rank["breakdown"]:
            out.print(f"  {line}", highlight=False)
