"""`tierzero plan`: the memory ledger of a model on a machine, and where its state should live."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import typer
from rich import box
from rich.table import Table

from tierzero.cli.output import Output
from tierzero.config import Config, DType, StateKind, Tier, parse_bytes
from tierzero.errors import ConfigError
from tierzero.ledger import (GB, activation_memory, check_world_size, ledger, nearest_preset, nominal_numel,
                             parse_count, scaled_units, units_from_args)
from tierzero.models.llama import LOSS_CHUNK_BYTES
from tierzero.models.presets import PRESETS, get_preset
from tierzero.plan import Link, Workload, candidate_placements, choose, estimate, load_profile
from tierzero.precision import TORCH_DTYPES

DEFAULT_PRESET = "7b"


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
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Print the 16-byte ledger per GPU (DDP, ZeRO 1-3), the stage-3 offload placements, the
    activation memory, which placement fits this machine, and its peak in every tier, part by part.

    Model shapes: a preset (--model; the LLaMA-3 shapes are llama3-8b and llama3-70b), a
    parameter count shaped like the nearest preset (--params), and --vocab-size to change a
    shape's vocabulary."""
    check_world_size(gpus)
    if vocab_size is not None and vocab_size < 1:
        raise ConfigError(f"--vocab-size must be a positive integer, got {vocab_size}")
    if model is not None and params is not None:
        raise ConfigError("give --model or --params, not both")
    compute = _dtype(dtype)
    itemsize = TORCH_DTYPES[compute].itemsize
    if params is not None:
        numel = parse_count(params, "--params")
        shape_name, ledger_numel = nearest_preset(numel), numel
        args = get_preset(shape_name)
        units = scaled_units(numel, args)
    else:
        shape_name = model or DEFAULT_PRESET
        args = get_preset(shape_name)
        if vocab_size is not None:
            args = dataclasses.replace(args, vocab_size=vocab_size)
        units = units_from_args(args)
        numel = args.param_count()
        ledger_numel = (nominal_numel(shape_name) if vocab_size is None else None) or numel
    activations = activation_memory(args, batch_size, seq_len or args.max_seq_len, itemsize, LOSS_CHUNK_BYTES)
    budgets, detected, device = _budgets(gpu_mem, host_mem, nvme_free, nvme_path, gpus)
    # grads are fp32 in every tier, as the engine keeps them (the ledger above is the textbook 16 B)
    work = Workload(tuple(units), itemsize, 4, gpus, prefetch_depth, activations,
                    batch_size * activations.seq_len, args.tie_embeddings, piece_numel,
                    overlap and compute is not DType.FP16, device)
    prof = load_profile(profile) if profile is not None else None
    estimates = [estimate(p, work, prof) for p in candidate_placements()]
    choice = choose(estimates, budgets)

    report: dict[str, Any] = {
        "model": {"preset": None if params is not None else shape_name, "shape": shape_name,
                  "params": numel, "ledger_params": ledger_numel, "units": len(units),
                  "largest_unit_params": work.largest_unit_numel, "vocab_size": args.vocab_size},
        "machine": {"gpus": gpus, "detected": detected, "device": device,
                    **{f"{t.value}_budget_bytes": b for t, b in budgets.items()}},
        "dtype": compute.value,
        "ledger": [{"stage": r.stage.value, "bytes_per_param": r.bytes_per_param,
                    "gb_per_gpu": round(r.bytes_per_gpu / GB, 4),
                    "exact_gb_per_gpu": round(r.bytes_per_param * numel / GB, 4)}
                   for r in ledger(ledger_numel, gpus, itemsize)],
        "activations": {"batch_size": activations.batch_size, "seq_len": activations.seq_len,
                        "checkpoints_bytes": activations.checkpoints_bytes,
                        "block_backward_bytes": activations.block_backward_bytes,
                        "head_backward_bytes": activations.head_backward_bytes,
                        "logits_bytes": activations.logits_bytes, "chunk_tokens": activations.chunk_tokens,
                        "forward_bytes": activations.forward_bytes, "backward_bytes": activations.backward_bytes,
                        "total_bytes": activations.total_bytes},
        "placements": [{**e.as_dict(), "fits": not e.overflow_bytes(budgets)} for e in estimates],
        "verdict": {**choice.as_dict(), "breakdown": choice.estimate.memory.breakdown()},
    }
    out = Output(json_out)
    if json_out:
        out.emit_json(report)
        return
    _print_report(out, report)


def _dtype(value: str) -> DType:
    try:
        return DType(value.lower())
    except ValueError:
        raise ConfigError(f"--dtype '{value}' is not valid; choose one of bf16|fp16|fp32") from None


def _budgets(gpu_mem: Optional[str], host_mem: Optional[str], nvme_free: Optional[str], nvme_path: Path,
             gpus: int) -> tuple[dict[Tier, int | None], list[str], str]:
    """The given sizes, else what this machine has; a note per size that was detected; and
    the compute device's kind ("cpu" without CUDA and without --gpu-mem)."""
    import torch

    detected = []
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    device = "cuda" if gpu_mem is not None or torch.cuda.is_available() else "cpu"
    host = parse_bytes(host_mem, "--host-mem") if host_mem is not None else None
    if host is None:
        host = ram
        detected.append("host")
    gpu = parse_bytes(gpu_mem, "--gpu-mem") if gpu_mem is not None else None
    if gpu is None and device == "cuda":
        gpu = torch.cuda.get_device_properties(0).total_memory
        detected.append("gpu")
    elif gpu is None:  # without CUDA the gpu tier is host memory: the host budget holds it
        detected.append("gpu (host memory, no CUDA)")
    nvme = parse_bytes(nvme_free, "--nvme-free") if nvme_free is not None else None
    if nvme is None:
        if not nvme_path.is_dir():
            raise ConfigError(f"--nvme-path '{nvme_path}' is not a directory; give an existing one or --nvme-free")
        nvme = shutil.disk_usage(nvme_path).free
        detected.append("nvme")
    return {Tier.GPU: gpu, Tier.HOST: host, Tier.NVME: nvme}, detected, device


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
    t = Table(title="Stage-3 placements: GB at peak (gpu per GPU, rest per machine), GB moved per step",
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
