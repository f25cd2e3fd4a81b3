"""What compact optimizer state saves on NVMe: bytes per parameter per step, and on disk.

For fp32 / bf16 / int8 Adam moments and fp32 / bf16 master weights, everything on NVMe, this
runs one step of the 134M LLaMA shape (after one warm-up step, which fills the page cache and
allocator) and prints NVMe bytes per parameter read and written in the step, the bytes per
parameter of params, master and moments the store holds (its arrays: `tierzero.checkpoint.inspect.store_info`;
with bf16 compute a bf16 master is the param)
and the blocks the store directory uses per parameter (params, grads and spare chunk files
included; chunk files are sparse past their data), and
each format's bytes per step relative to fp32's.

    nice python benchmarks/compact_state.py            # 134M: GPT-3 small's shape, LLaMA blocks, vocab 32000
    nice python benchmarks/compact_state.py --quick    # a small shape, in seconds
    nice python benchmarks/compact_state.py --clip-grad-norm 1.0  # grads through their NVMe home

Without clipping each unit is stepped as its grad arrives (overlap_step): grads never reach
the drive, and the figures hold no grads at all.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time

from rich.console import Console
from rich.table import Table

from tierzero import Config, Placement, Tier, models
from tierzero.checkpoint.inspect import store_info
from tierzero.engine import Engine
from tierzero.bench.shapes import nvme_shape
from tierzero.models import ModelArgs
from tierzero.run.data import TokenBatches, default_corpus

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
FORMATS = [(m, w) for m in ("fp32", "bf16", "int8") for w in ("fp32", "bf16")]  # (moments, master)
STATE = ("param", "master", "exp_avg", "exp_avg_sq")  # weights and optimizer state (grads are rewritten each step)


def one_step(args: ModelArgs, moments: str, master: str, opts: argparse.Namespace, path: str) -> dict[str, float]:
    """NVMe bytes per parameter of one step (after a warm-up step) and what the store then holds."""
    cfg = Config(placement=NVME, nvme_path=[path], dtype=opts.dtype, lr=1e-4, total_steps=4,
                 host_budget=opts.host_budget, optimizer_state=moments, master=master,
                 clip_grad_norm=opts.clip_grad_norm)
    data = TokenBatches(default_corpus(4 << 20), opts.batch_size, opts.seq_len, seed=0)
    with Engine(models.build(args, device="meta"), cfg) as engine:
        n = sum(u.trainable_numel for u in engine.units)
        engine.train_step(data.next_batch())  # warm-up
        engine.stats()
        t0 = time.perf_counter()
        loss = engine.train_step(data.next_batch())
        seconds = time.perf_counter() - t0
        stats = engine.stats()
    store = store_info(f"{path}")
    state = sum(store.kinds[k].nbytes for k in STATE if k in store.kinds)
    du = subprocess.run(["du", "-s", "--block-size=1", path], capture_output=True, text=True, check=True)
    disk = int(du.stdout.split()[0])  # blocks in use: chunk files are sparse past their data
    return {"read": stats.get("bytes_nvme->host", 0) / n, "written": stats.get("bytes_host->nvme", 0) / n,
            "state": state / n, "disk": disk / n, "seconds": seconds, "loss": loss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small shape (4 layers, dim 256, vocab 4096)")
    p.add_argument("--dtype", default="bf16", help="the compute dtype (params on NVMe in it)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--host-budget", default="512MiB", help="small enough that the host cache cannot hold the params")
    p.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip (the step then waits for the norm: grads go through their NVMe home)")
    p.add_argument("--nvme-path", default=None, help="a directory on the drive to measure (default: a temp dir)")
    opts = p.parse_args()
    args, opts.host_budget = nvme_shape(opts.quick, opts.host_budget)
    console = Console()
    n = sum(p.numel() for p in models.build(args, device="meta").parameters())
    console.print(f"built-in: {n / 1e6:.1f}M params, {opts.dtype} compute, everything on NVMe, micro-batch "
                  f"{opts.batch_size} x {opts.seq_len}, host budget {opts.host_budget}", markup=False)
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for moments, master in FORMATS:
        with tempfile.TemporaryDirectory(dir=opts.nvme_path) as path:
            rows[moments, master] = one_step(args, moments, master, opts, path)
        console.print(f"  moments {moments}, master {master}: {rows[moments, master]}", markup=False)
    base = rows["fp32", "fp32"]
    table = Table(title="NVMe bytes per parameter: per step, and on disk")
    for column in ("moments", "master", "read/step", "written/step", "total/step", "vs fp32",
                   "weights+state on disk", "disk use", "step s"):
        table.add_column(column, justify="right")
    for (moments, master), r in rows.items():
        total = r["read"] + r["written"]
        table.add_row(moments, master, f"{r['read']:.2f}", f"{r['written']:.2f}", f"{total:.2f}",
                      f"{total / (base['read'] + base['written']):.3f}x", f"{r['state']:.2f}", f"{r['disk']:.2f}",
                      f"{r['seconds']:.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
