"""bf16 through the engine vs the fp32 reference trainer: do the loss curves track?

Trains the `tiny` preset for `--steps` steps twice from the same seed and batches — once
through `tierzero.Engine` in bf16 (fp32 master weights and moments, fp32 grads, everything on
NVMe) and once through the in-memory reference trainer in fp32 — and prints the mean loss of
each window of `--window` steps side by side with the difference.

    python benchmarks/bench_bf16_tracking.py --steps 200 --batch-size 4 --seq-len 64
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from tierzero import Config, Engine, models
from tierzero.reference import ReferenceTrainer
from tierzero.run.data import TokenBatches, default_corpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    a = p.parse_args()
    tokens = default_corpus(4 << 20)
    common = dict(lr=a.lr, total_steps=a.steps, warmup_steps=a.steps // 20)
    curves, seconds = {}, {}
    with tempfile.TemporaryDirectory(dir=".") as nvme:
        cfg = Config(offload="nvme", nvme_path=[nvme], dtype="bf16", **common)
        data = TokenBatches(tokens, a.batch_size, a.seq_len, seed=0)
        t0 = time.perf_counter()
        with Engine(models.build("tiny", device="meta"), cfg) as engine:
            curves["engine bf16"] = [engine.train_step(data.next_batch()) for _ in range(a.steps)]
        seconds["engine bf16"] = time.perf_counter() - t0
    data = TokenBatches(tokens, a.batch_size, a.seq_len, seed=0)
    t0 = time.perf_counter()
    reference = ReferenceTrainer(
        models.build("tiny"), Config(offload="none", dtype="fp32", **common)
    )
    curves["reference fp32"] = [reference.train_step(data.next_batch()) for _ in range(a.steps)]
    seconds["reference fp32"] = time.perf_counter() - t0
    w = a.window
    ours, theirs = (np.array(c[: a.steps // w * w]).reshape(-1, w).mean(1) for c in curves.values())
    table = Table(
        title=f"tiny, {a.steps} steps of {a.batch_size} x {a.seq_len}: mean loss per {w} steps"
    )
    for col in ("steps", "engine bf16", "reference fp32", "difference"):
        table.add_column(col, justify="right")
    for i, (x, y) in enumerate(zip(ours, theirs)):
        table.add_row(f"{i * w + 1}-{(i + 1) * w}", f"{x:.3f}", f"{y:.3f}", f"{x - y:+.3f}")
    console = Console()
    console.print(table)
    console.print(
        f"max |difference| {np.abs(ours - theirs).max():.3f} nats; wall "
        + ", ".join(f"{k} {v:.0f}s" for k, v in seconds.items())
    )


if __name__ == "__main__":
    main()
