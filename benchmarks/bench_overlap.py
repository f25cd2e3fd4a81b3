"""How well the engine hides NVMe traffic behind compute: the overlap ratio.

    overlap ratio = nvme step time / max(compute-only step, I/O-only step)

measured side by side in one run, interleaved, median of several steps each:

- compute-only: the same model and batch with every state resident on the compute device
  (placement all-gpu: no tier traffic at all);
- I/O-only: everything on NVMe with a one-token batch, so the engine moves exactly the same
  bytes (they do not depend on the batch) while compute is negligible;
- nvme: everything on NVMe with the real batch.

Each nvme variant runs with overlap_step off and on (the default: each unit's optimizer step
during backward), against the I/O-only step of the same mode. A ratio of 1.0 means I/O is
fully hidden; 2.0 means none of it is.

    python benchmarks/bench_overlap.py --layers 8 --dim 512 --batch-size 8 --seq-len 256
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table
from shapes import add_shape_flags, shape

from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.models import ModelArgs
from tierzero.run.data import TokenBatches, default_corpus

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)


def step_times(
    args: ModelArgs,
    placement: Placement,
    batch_size: int,
    seq_len: int,
    steps: int,
    path: str,
    **kw,
) -> tuple[list[float], dict]:
    cfg = Config(placement=placement, nvme_path=[path], lr=1e-4, total_steps=steps + 2, **kw)
    data = TokenBatches(default_corpus(4 << 20), batch_size, seq_len, seed=0)
    times = []
    with Engine(models.build(args, device="meta"), cfg) as engine:
        engine.train_step(data.next_batch())  # warm-up: allocator, page cache, threads
        engine.stats()
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.train_step(data.next_batch())
            times.append(time.perf_counter() - t0)
        stats = engine.stats()
    return times, stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_flags(p, layers=8, dim=512, batch_size=8, seq_len=256)
    p.add_argument("--path", default=None, help="NVMe directory (default: a temp dir under .)")
    a = p.parse_args()
    args = shape(a)
    console = Console()
    console.print(
        f"model: {a.layers} layers x dim {a.dim} = {args.param_count() / 1e6:.1f}M params; "
        f"batch {a.batch_size} x {a.seq_len}; torch threads {torch.get_num_threads()}"
    )
    off, on = {"overlap_step": False}, {"overlap_step": True}
    variants = {
        "compute-only (all-gpu)": (Placement(), a.batch_size, a.seq_len, {}),
        "I/O-only, overlap_step off": (NVME, 1, 1, off),
        "nvme, overlap_step off": (NVME, a.batch_size, a.seq_len, off),
        "I/O-only, overlap_step on": (NVME, 1, 1, on),
        "nvme, overlap_step on (default)": (NVME, a.batch_size, a.seq_len, on),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    moved: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=a.path or ".") as root:
        for r in range(a.rounds):
            for name, (placement, bs, sl, kw) in variants.items():
                times, stats = step_times(
                    args, placement, bs, sl, a.steps, f"{root}/{r}-{len(samples[name])}", **kw
                )
                samples[name] += times
                moved[name] = (
                    sum(
                        v
                        for k, v in stats.items()
                        if k.startswith("bytes_nvme") or k.endswith("->nvme")
                    )
                    / a.steps
                )
    med = {name: statistics.median(v) for name, v in samples.items()}
    compute = med["compute-only (all-gpu)"]
    ratio = {
        mode: med[f"nvme, overlap_step {mode}" + (" (default)" if mode == "on" else "")]
        / max(compute, med[f"I/O-only, overlap_step {mode}"])
        for mode in ("off", "on")
    }
    table = Table(title="step time, median over interleaved rounds")
    for col in ("variant", "step s", "nvme bytes / step"):
        table.add_column(col, justify="right" if col != "variant" else "left")
    for name, t in med.items():
        table.add_row(name, f"{t:.3f}", f"{moved.get(name, 0) / 1e6:,.0f} MB")
    console.print(table)
    console.print(
        f"overlap ratio (nvme step / max(compute-only, I/O-only)): overlap_step off "
        f"{ratio['off']:.2f}, on {ratio['on']:.2f}; overlap_step saves "
        f"{1 - med['nvme, overlap_step on (default)'] / med['nvme, overlap_step off']:.0%} "
        "of the nvme step"
    )


if __name__ == "__main__":
    main()
