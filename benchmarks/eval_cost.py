"""What evaluation during training costs in bytes read from the drive, by the kernel's count.

A LoRA fine-tune (r = 8) of a 134M-shape Hugging Face LLaMA (hidden 768, 12 layers, MLP 2048,
vocabulary 32000, untied; built from a `LlamaConfig` and saved with `save_pretrained`), every
state on NVMe, a 64 MiB host budget on a GPU (on the CPU device the compute pool lives in host
memory, and holding a unit in flight and its staging buffer in fp32 takes 254 MB: 256 MiB
there), micro-batches of 1 x 32 tokens, 6 steps, an evaluation before the first step and every
3 (the default 4,096 evaluation tokens: 128 windows). It runs
as `tierzero train` does (`open_session`, `Session.train`), reading this process's
`read_bytes` from /proc/self/io around every training step and every evaluation: bytes that
reached the block device (the tiers read NVMe with O_DIRECT, so the page cache hides none of
the state's reads). The base is the median training step's bytes. After the run the same
validation set is evaluated once more the way evaluation ran before (`Engine.eval_loss`, a
full pass per window) for comparison, and the one-pass loss is checked against it.

    python benchmarks/eval_cost.py                 # the 134M run above
    python benchmarks/eval_cost.py --quick         # a small shape, in seconds
    python benchmarks/eval_cost.py --no-per-window # skip the per-window comparison (~24 GB read)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from tierzero.bench.shapes import HF_QUICK, HF_SHAPE
from tierzero.configfile import load_run_config
from tierzero.run.data import default_corpus
from tierzero.run.directory import RunDir
from tierzero.run.loop import evaluate
from tierzero.run.session import open_session


def read_bytes() -> int:
    """This process's bytes read from a block device so far (O_DIRECT reads included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("read_bytes:"))


def save_model(path: Path, shape: dict[str, int]) -> Path:
    """A random-weight LLaMA of `shape`, saved with save_pretrained (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False)).save_pretrained(path)
    return path


def measured(
    calls: list[tuple[str, int, float]], kind: str, fn: Callable[..., Any]
) -> Callable[..., Any]:
    """`fn`, recording each call's bytes read and seconds under `kind`."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before, t0 = read_bytes(), time.perf_counter()
        out = fn(*args, **kwargs)
        calls.append((kind, read_bytes() - before, time.perf_counter() - t0))
        return out

    return wrapper


def run(opts: argparse.Namespace, root: Path) -> dict[str, Any]:
    model_dir = save_model(root / "model", HF_QUICK if opts.quick else HF_SHAPE)
    tokens = default_corpus(1 << 20).astype(np.uint16)  # byte ids: within any vocabulary here
    np.save(root / "tokens.npy", tokens)
    settings = {
        "model": f"hf:{model_dir}",
        "data": str(root / "tokens.npy"),
        "lora_r": 8,
        "offload": "nvme",
        "host_budget": opts.host_budget,
        "batch_size": 1,
        "seq_len": 32,
        "steps": opts.steps,
        "eval_every": opts.eval_every,
        "nvme_path": [str(root / "nvme")],
        "run_dir": str(root / "run"),
    }
    run_cfg = load_run_config(overrides=settings)
    calls: list[tuple[str, int, float]] = []
    with RunDir(run_cfg.run_dir) as rundir, open_session(run_cfg) as session:
        rundir.start(run_cfg, False, False)
        rundir.open_metrics(0)
        engine = session.trainer
        engine.open()  # the base materialised into its tiers: not the evaluation's cost
        engine.train_micro_batch = measured(calls, "step", engine.train_micro_batch)
        engine.evaluate = measured(calls, "evaluation", engine.evaluate)
        before = read_bytes()
        result = session.train(rundir)
        total = read_bytes() - before
        per_window = None
        if opts.per_window:
            windows = session.batches.val_batches(run_cfg.evaluation.eval_tokens)
            t0, start = read_bytes(), time.perf_counter()
            loss = evaluate(_PerWindow(engine), session.batches, run_cfg.evaluation.eval_tokens)
            per_window = (read_bytes() - t0, time.perf_counter() - start, loss, len(windows))
    return {
        "calls": calls,
        "total": total,
        "per_window": per_window,
        "last_eval": result.val_losses[-1][1],
    }


class _PerWindow:
    """The engine as the loop saw it before `Engine.evaluate`: `eval_loss` per window only."""

    def __init__(self, engine: Any) -> None:
        self.eval_loss = engine.eval_loss


def report(result: dict[str, Any], console: Console) -> None:
    steps = [(b, s) for kind, b, s in result["calls"] if kind == "step"]
    evals = [(b, s) for kind, b, s in result["calls"] if kind == "evaluation"]
    base = statistics.median(b for b, _ in steps)
    table = Table(title="bytes read from the drive (/proc/self/io read_bytes)")
    for column in ("what", "GB read", "x base", "seconds"):
        table.add_column(column, justify="left" if column == "what" else "right")
    for i, (b, s) in enumerate(steps, start=1):
        table.add_row(f"training step {i}", f"{b / 1e9:.3f}", f"{b / base:.2f}", f"{s:.2f}")
    for i, (b, s) in enumerate(evals):
        table.add_row(f"evaluation {i} (one pass)", f"{b / 1e9:.3f}", f"{b / base:.2f}", f"{s:.2f}")
    table.add_row(
        "whole run (steps, evaluations, checkpoint)",
        f"{result['total'] / 1e9:.3f}",
        f"{result['total'] / base:.2f}",
        "",
    )
    if result["per_window"] is not None:
        b, s, _, n = result["per_window"]
        table.add_row(
            f"one evaluation, window by window ({n} passes)",
            f"{b / 1e9:.3f}",
            f"{b / base:.2f}",
            f"{s:.2f}",
        )
    console.print(table)
    if result["per_window"] is not None:
        one, per = result["last_eval"], result["per_window"][2]
        same = (
            "bitwise equal"
            if one == per
            else f"relative difference {abs(one - per) / abs(per):.2e}"
        )
        console.print(f"last eval loss: one pass {one!r}, window by window {per!r} ({same})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small shape, in seconds")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument(
        "--host-budget", default=None, help="default: 64MiB on a GPU, 256MiB on the CPU"
    )
    parser.add_argument(
        "--no-per-window",
        dest="per_window",
        action="store_false",
        help="skip evaluating window by window for comparison",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the model, data and run go (default: a temp dir)",
    )
    opts = parser.parse_args()
    if opts.host_budget is None:
        import torch

        opts.host_budget = "64MiB" if torch.cuda.is_available() else "256MiB"
    console = Console()
    if opts.dir is not None:
        opts.dir.mkdir(parents=True, exist_ok=True)
        report(run(opts, opts.dir), console)
        return
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        report(run(opts, Path(tmp)), console)


if __name__ == "__main__":
    main()
