"""How a step's links overlap: the 134M shape, everything on NVMe, as `tierzero report` shows it.

Trains STEPS steps (after one warm-up step, left out: it fills the page cache and the allocator)
of the 134M LLaMA shape with all state on NVMe, once per optimizer-state format (fp32, and int8
moments + bf16 master), and writes each run's metrics.jsonl into OUT/<format>/ so that
`tierzero report OUT/<format>` prints its overlap table: each link's busy time against the step.

    nice python benchmarks/link_overlap.py --out /tmp/overlap --steps 4
    tierzero report /tmp/overlap/fp32-fp32
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tierzero.storage.durable import write_atomic

from tierzero import Config, Placement, Tier, models
from tierzero.bench.shapes import nvme_shape
from tierzero.engine import Engine
from tierzero.run.data import TokenBatches, default_corpus

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
FORMATS = [("fp32", "fp32"), ("int8", "bf16")]  # (moments, master)


def run(moments: str, master: str, opts: argparse.Namespace, nvme: str, out: Path) -> None:
    """Train the steps and write their records (the train loop's keys) to `out`/metrics.jsonl."""
    args, host_budget = nvme_shape(opts.quick, opts.host_budget)
    cfg = Config(
        placement=NVME,
        nvme_path=[nvme],
        dtype=opts.dtype,
        lr=1e-4,
        total_steps=opts.steps + 1,
        host_budget=host_budget,
        optimizer_state=moments,
        master=master,
    )
    data = TokenBatches(default_corpus(4 << 20), opts.batch_size, opts.seq_len, seed=0)
    tokens = opts.batch_size * opts.seq_len
    records = []
    with Engine(models.build(args, device="meta"), cfg) as engine:
        engine.train_step(data.next_batch())  # warm-up
        engine.stats()
        start = time.perf_counter()
        for step in range(1, opts.steps + 1):
            t0 = time.perf_counter()
            loss = float(engine.train_step(data.next_batch()))
            dt = time.perf_counter() - t0
            records.append(
                {
                    "step": step,
                    "loss": loss,
                    "lr": cfg.optimizer.lr,
                    "tokens_per_s": tokens / dt,
                    "step_s": dt,
                    "wall_s": time.perf_counter() - start,
                    **engine.stats(),
                }
            )
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="where each format's run directory goes")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="a small shape (4 layers, dim 256)")
    p.add_argument("--dtype", default="bf16", help="the compute dtype (params on NVMe in it)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument(
        "--host-budget",
        default="512MiB",
        help="small enough that the host cache cannot hold the params",
    )
    p.add_argument(
        "--nvme-path",
        default=None,
        help="a directory on the drive to measure (default: a temp dir)",
    )
    opts = p.parse_args()
    for moments, master in FORMATS:
        with tempfile.TemporaryDirectory(dir=opts.nvme_path) as nvme:
            run(moments, master, opts, nvme, opts.out / f"{moments}-{master}")


if __name__ == "__main__":
    main()
