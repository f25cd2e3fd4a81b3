"""What compact optimizer state saves on NVMe: bytes per parameter per step, and on disk.

For fp32 / bf16 / int8 Adam moments and fp32 / bf16 master weights, everything on NVMe, this
runs one step of the 134M LLaMA shape (after one warm-up step, which fills the page cache and
allocator) and prints NVMe bytes per parameter read and written in the step, the bytes per
parameter of params, master and moments the store holds (its arrays:
`tierzero.checkpoint.inspect.store_info`; with bf16 compute a bf16 master is the param) and the
blocks the store directory uses per parameter (params, grads and spare chunk files included;
chunk files are sparse past their data), and each format's bytes per step relative to fp32's.

    nice python benchmarks/compact_state.py            # 134M: GPT-3 small's shape, vocab 32000
    nice python benchmarks/compact_state.py --quick    # a small shape, in seconds
    nice python benchmarks/compact_state.py --clip-grad-norm 1.0  # grads through their NVMe home
    nice python benchmarks/compact_state.py --race 6   # step times: fp32 / int8+bf16 x 2 / fp32

`--race STEPS` instead trains fp32 state and int8 moments + bf16 master interleaved (fp32,
compact, compact, fp32, so a machine that slows down over the run slows both alike), STEPS
steps each, and prints their step times side by side with the bytes each step moved to and
from the drive as the OS counts them (/proc/self/io: read_bytes + write_bytes), the first step
of each run left out (it fills the page cache, the allocator and the kernel's cache).

Without clipping each unit is stepped as its grad arrives (overlap_step): grads never reach
the drive, and the figures hold no grads at all.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time

from rich.console import Console
from rich.table import Table

from tierzero import Config, Placement, Tier, models
from tierzero.bench.shapes import nvme_shape
from tierzero.checkpoint.inspect import store_info
from tierzero.engine import Engine
from tierzero.models import ModelArgs
from tierzero.run.data import TokenBatches, default_corpus

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
FORMATS = [(m, w) for m in ("fp32", "bf16", "int8") for w in ("fp32", "bf16")]  # (moments, master)
# weights and optimizer state (grads are rewritten each step)
STATE = (
    "param",
    "master",
    "exp_avg",
    "exp_avg_sq",
)


def one_step(
    args: ModelArgs, moments: str, master: str, opts: argparse.Namespace, path: str
) -> dict[str, float]:
    """NVMe bytes per parameter of one step (after a warm-up step) and what the store then holds."""
    cfg = Config(
        placement=NVME,
        nvme_path=[path],
        dtype=opts.dtype,
        lr=1e-4,
        total_steps=4,
        host_budget=opts.host_budget,
        optimizer_state=moments,
        master=master,
        clip_grad_norm=opts.clip_grad_norm,
    )
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
    du = subprocess.run(
        ["du", "-s", "--block-size=1", path], capture_output=True, text=True, check=True
    )
    disk = int(du.stdout.split()[0])  # blocks in use: chunk files are sparse past their data
    return {
        "read": stats.get("bytes_nvme->host", 0) / n,
        "written": stats.get("bytes_host->nvme", 0) / n,
        "state": state / n,
        "disk": disk / n,
        "seconds": seconds,
        "loss": loss,
    }


def race_run(
    args: ModelArgs, moments: str, master: str, opts: argparse.Namespace, path: str
) -> list[tuple[float, int, float]]:
    """Each step's seconds, the bytes /proc/self/io says it read and wrote, and its loss, for
    one format (every run trains the same init on the same batches)."""
    cfg = Config(
        placement=NVME,
        nvme_path=[path],
        dtype=opts.dtype,
        lr=1e-4,
        total_steps=opts.race,
        host_budget=opts.host_budget,
        optimizer_state=moments,
        master=master,
        clip_grad_norm=opts.clip_grad_norm,
    )
    data = TokenBatches(default_corpus(4 << 20), opts.batch_size, opts.seq_len, seed=0)
    steps = []
    with Engine(models.build(args, device="meta"), cfg) as engine:
        for _ in range(opts.race):
            batch = data.next_batch()
            io, t0 = proc_io_bytes(), time.perf_counter()
            loss = engine.train_step(batch)
            steps.append((time.perf_counter() - t0, proc_io_bytes() - io, loss))
    return steps


def proc_io_bytes() -> int:
    """Bytes this process read from and wrote to block devices (O_DIRECT included)."""
    with open("/proc/self/io") as f:
        fields = {k: int(v) for k, v in (line.split(":") for line in f)}
    return fields["read_bytes"] + fields["write_bytes"]


def race(args: ModelArgs, opts: argparse.Namespace, console: Console) -> None:
    order = [("fp32", "fp32"), ("int8", "bf16"), ("int8", "bf16"), ("fp32", "fp32")]
    runs: dict[tuple[str, str], list[tuple[float, int, float]]] = {f: [] for f in order}
    losses: dict[tuple[str, str], list[float]] = {}
    for moments, master in order:
        with tempfile.TemporaryDirectory(dir=opts.nvme_path) as path:
            steps = race_run(args, moments, master, opts, path)
        losses.setdefault((moments, master), [loss for _, _, loss in steps])
        runs[moments, master] += steps[1:]
        console.print(
            f"  {moments} moments, {master} master: "
            + ", ".join(f"{s:.1f} s {b / 1e6:.0f} MB loss {x:.4f}" for s, b, x in steps[1:]),
            markup=False,
        )
    off = max(abs(a / b - 1) for a, b in zip(losses["int8", "bf16"], losses["fp32", "fp32"]))
    console.print(f"  the int8 + bf16 losses, at every step, within {off:.2%} of fp32's")
    table = Table(
        title=f"one step, median of {len(runs[order[0]])} (runs interleaved: "
        + " / ".join(f"{m}+{w}" for m, w in order)
        + ")"
    )
    for column in ("moments", "master", "step s", "vs fp32", "OS bytes/step", "vs fp32"):
        table.add_column(column, justify="right")
    base = {k: statistics.median(x[k] for x in runs["fp32", "fp32"]) for k in (0, 1)}
    for (moments, master), steps in runs.items():
        seconds, nbytes = (statistics.median(x[k] for x in steps) for k in (0, 1))
        table.add_row(
            moments,
            master,
            f"{seconds:.2f}",
            f"{seconds / base[0]:.3f}x",
            f"{nbytes / 1e6:.0f} MB",
            f"{nbytes / base[1]:.3f}x",
        )
    console.print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="a small shape (4 layers, dim 256, vocab 4096)"
    )
    p.add_argument("--dtype", default="bf16", help="the compute dtype (params on NVMe in it)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument(
        "--host-budget",
        default="512MiB",
        help="small enough that the host cache cannot hold the params",
    )
    p.add_argument(
        "--clip-grad-norm",
        type=float,
        default=None,
        help="clip (the step then waits for the norm: grads go through their NVMe home)",
    )
    p.add_argument(
        "--nvme-path",
        default=None,
        help="a directory on the drive to measure (default: a temp dir)",
    )
    p.add_argument(
        "--race",
        type=int,
        default=None,
        metavar="STEPS",
        help="step times of fp32 and int8 + bf16 state, interleaved, STEPS steps each",
    )
    opts = p.parse_args()
    args, opts.host_budget = nvme_shape(opts.quick, opts.host_budget)
    console = Console()
    n = sum(p.numel() for p in models.build(args, device="meta").parameters())
    console.print(
        f"built-in: {n / 1e6:.1f}M params, {opts.dtype} compute, everything on NVMe, micro-batch "
        f"{opts.batch_size} x {opts.seq_len}, host budget {opts.host_budget}",
        markup=False,
    )
    if opts.race:
        race(args, opts, console)
        return
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for moments, master in FORMATS:
        with tempfile.TemporaryDirectory(dir=opts.nvme_path) as path:
            rows[moments, master] = one_step(args, moments, master, opts, path)
        console.print(
            f"  moments {moments}, master {master}: {rows[moments, master]}", markup=False
        )
    base = rows["fp32", "fp32"]
    table = Table(title="NVMe bytes per parameter: per step, and on disk")
    for column in (
        "moments",
        "master",
        "read/step",
        "written/step",
        "total/step",
        "vs fp32",
        "weights+state on disk",
        "disk use",
        "step s",
    ):
        table.add_column(column, justify="right")
    for (moments, master), r in rows.items():
        total = r["read"] + r["written"]
        table.add_row(
            moments,
            master,
            f"{r['read']:.2f}",
            f"{r['written']:.2f}",
            f"{total:.2f}",
            f"{total / (base['read'] + base['written']):.3f}x",
            f"{r['state']:.2f}",
            f"{r['disk']:.2f}",
            f"{r['seconds']:.1f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
