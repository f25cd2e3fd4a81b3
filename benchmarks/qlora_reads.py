"""What an NF4 base (`--quantize-base nf4`) saves in bytes read from the drive, by the kernel's
count.

A LoRA fine-tune (r = 8) of a 134M-shape Hugging Face LLaMA (hidden 768, 12 layers, MLP 2048,
vocabulary 32000, untied; built from a `LlamaConfig` and saved with `save_pretrained`), every
state on NVMe, a 64 MiB host budget on a GPU (256 MiB on the CPU device, whose compute pool
is host memory), micro-batches of 1 x 32 tokens, 6 steps, no evaluation: once with the base in
the compute dtype and once with `--quantize-base nf4`, from one saved model. Each runs as
`tierzero train` does (`open_session`, `Session.train`), reading this process's `read_bytes`
from /proc/self/io around every training step (the tiers read NVMe with O_DIRECT, so the
page cache hides none of the state's reads). A step reads every unit's params twice (forward,
then backward's recompute) plus the adapters' state, so the base's bytes dominate: in fp32
(the CPU's compute dtype) NF4 reads 0.5625 of 4 bytes per quantised weight, in bf16 of 2.

    python benchmarks/qlora_reads.py                      # the 134M run above
    python benchmarks/qlora_reads.py --quick              # a small shape, in seconds
    python benchmarks/qlora_reads.py --host-budget 64MiB  # default: 64MiB on a GPU, 256MiB on CPU
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
from tierzero.run.session import open_session

BASES = ("none", "nf4")


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


def measured(steps: list[tuple[int, float]], fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, recording each call's bytes read and seconds."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before, t0 = read_bytes(), time.perf_counter()
        out = fn(*args, **kwargs)
        steps.append((read_bytes() - before, time.perf_counter() - t0))
        return out

    return wrapper


def run(opts: argparse.Namespace, root: Path, model_dir: Path, base: str) -> dict[str, Any]:
    """One run with the base stored as `base`: each step's bytes read, the run's, the losses."""
    settings = {
        "model": f"hf:{model_dir}",
        "data": str(root / "tokens.npy"),
        "lora_r": 8,
        "quantize_base": base,
        "offload": "nvme",
        "host_budget": opts.host_budget,
        "batch_size": 1,
        "seq_len": 32,
        "steps": opts.steps,
        "eval_every": 0,
        "nvme_path": [str(root / base / "nvme")],
        "run_dir": str(root / base / "run"),
    }
    run_cfg = load_run_config(overrides=settings)
    steps: list[tuple[int, float]] = []
    with RunDir(run_cfg.run_dir) as rundir, open_session(run_cfg) as session:
        rundir.start(run_cfg, False, False)
        rundir.open_metrics(0)
        engine = session.trainer
        engine.open()  # the base read from its safetensors into the tiers: not a step's cost
        engine.train_micro_batch = measured(steps, engine.train_micro_batch)
        before = read_bytes()
        result = session.train(rundir)
        total = read_bytes() - before
    return {
        "steps": steps,
        "total": total,
        "losses": (result.first_loss, result.last_loss),
    }


def report(results: dict[str, dict[str, Any]], console: Console) -> None:
    table = Table(title="bytes read from the drive per training step (/proc/self/io read_bytes)")
    for column in (
        "base",
        "median MB/step",
        "x none",
        "whole run MB",
        "median s/step",
        "loss",
    ):
        table.add_column(column, justify="left" if column == "base" else "right")
    plain = statistics.median(b for b, _ in results["none"]["steps"])
    for base, result in results.items():
        step = statistics.median(b for b, _ in result["steps"])
        seconds = statistics.median(s for _, s in result["steps"])
        losses = result["losses"]
        table.add_row(
            base,
            f"{step / 1e6:.1f}",
            f"{step / plain:.3f}",
            f"{result['total'] / 1e6:.1f}",
            f"{seconds:.2f}",
            f"{losses[0]:.4f} -> {losses[-1]:.4f}",
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small shape, in seconds")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--host-budget", default=None, help="default: 64MiB on a GPU, 256MiB on the CPU"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the model, data and runs go (default: a temp dir)",
    )
    opts = parser.parse_args()
    if opts.host_budget is None:  # on the CPU device the compute pool is host memory too: a unit
        import torch  # in flight and its staging buffer in fp32 take 254 MB

        opts.host_budget = "64MiB" if torch.cuda.is_available() else "256MiB"
    console = Console()
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        root = opts.dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        model_dir = save_model(root / "model", HF_QUICK if opts.quick else HF_SHAPE)
        tokens = default_corpus(1 << 20).astype(np.uint16)  # byte ids: within any vocabulary here
        np.save(root / "tokens.npy", tokens)
        report({base: run(opts, root, model_dir, base) for base in BASES}, console)


if __name__ == "__main__":
    main()
