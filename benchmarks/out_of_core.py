"""Out of core: train a model whose training state is larger than this machine's RAM.

The script picks a LLaMA-style shape (vocab 32000, untied embedding and head) whose training
state -- every state kind on NVMe: param, grad, master, exp_avg, exp_avg_sq, 20 bytes per
parameter in fp32 (18 in bf16: gradients stay fp32; fewer with `--optimizer-state` and
`--master`: int8 moments and a bf16 master with bf16 compute store 8.0) -- is at least
`--ram-multiple` x this machine's RAM (MemTotal), or takes a preset's shape (`--preset 7b`),
builds it on `meta`, and trains it a few steps through `tierzero.Engine` with a host budget of
`--host-fraction` x RAM. It reports:

- the shape, the state's bytes, RAM, the budgets;
- peak resident memory from the OS, per phase (disk measurement, materialise, each training
  step): VmHWM, reset at each phase's start through /proc/self/clear_refs, and the largest
  VmRSS sampled every 0.2 s by a background thread (the two should agree); and the disk space
  the run used at its peak (the drive's used bytes, sampled beside VmRSS, less those used
  before the run began);
- per step: loss, step time, every `bytes_*` and `peak_*` counter of `engine.stats()` (bytes
  per tier and direction, whatever the engine reports; the pools' peaks, reset before every
  step so they are per step), NVMe bytes per parameter, this process's read_bytes /
  write_bytes from /proc/self/io (what reached a block device) beside the engine's counts, and
  the I/O wait share: the engine's `io_wait_s` (every wait of the training thread on a
  transfer, the step's drains and pool back-pressure included);
- the drive's store read and write bandwidth, measured in the same run right before training
  by `tierzero.planning.diskbench.DiskBench` (its first, always-run group: layout, one round of raw
  direct I/O and of the store, cold reads of a slot written earlier, random data) on the same
  directory; and from them the I/O bounds of a step,
      serial     = nvme bytes read / read GB/s + nvme bytes written / write GB/s
      overlapped = max(nvme bytes read / read GB/s, nvme bytes written / write GB/s)
  and the step time's ratio to each (1.0 = the step moves its bytes at the drive's speed).

Before anything is written it says how much disk it needs and refuses (one sentence, exit 1)
when the drive has less free; after the disk measurement (and two short compute measurements)
it says how long it expects to take. Everything goes under a fresh directory inside --path,
removed at the end, also after an error or Ctrl-C. If the engine refuses the budgets
(ConfigError), the error is printed and the exit status is 2.

    python benchmarks/out_of_core.py                              # 1.5x RAM: ~60 GB free, 10+ min
    python benchmarks/out_of_core.py --dry-run-params 50000000    # same code, ~50M params, ~1 min
    python benchmarks/out_of_core.py --steps 5 --path /mnt/ssd0 --json
    python benchmarks/out_of_core.py --preset 7b --dtype bf16 --optimizer-state int8 --master bf16

Never run in CI. The probes of the process (`RssWatch`, /proc's counters) live in
`tierzero.bench.procfs`, the tables in `out_of_core_report.py` beside this script.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from out_of_core_report import print_report
from rich.console import Console
from tierzero.storage.nvme.spares import SpareFiles

from tierzero import Config, Engine, models
from tierzero.bench.procfs import RssWatch, mem_total_bytes, proc_io
from tierzero.bench.sizing import (
    Estimate,
    estimate,
    llama_shape,
    measure_disk,
    state_bytes_per_param,
)
from tierzero.config import DType, parse_bytes
from tierzero.errors import ConfigError
from tierzero.models import ModelArgs
from tierzero.models.presets import get_preset
from tierzero.planning.diskbench import FOOTPRINT as BENCH_FOOTPRINT
from tierzero.planning.statebytes import StateBytes
from tierzero.run.data import TokenBatches, default_corpus

# Disk: the state, chunk padding and metadata (the brief's 1.3x, `--disk-slack`; the 7B runs
# peaked at 1.07-1.09x, spares included) plus up to `max_bytes` idle and retired spares a dir.
DISK_SLACK = 1.3
SPARE_BYTES = 2 * inspect.signature(SpareFiles).parameters["max_bytes"].default
GB = 1e9
MiB = 1 << 20


# -- the run's size --------------------------------------------------------------------------


@dataclass
class RunSize:
    """What the run trains and what it needs, decided before anything is written."""

    ram_bytes: int
    formats: StateBytes
    bytes_per_param: float
    args: ModelArgs
    params: int
    state_bytes: int
    bench_bytes: int  # written and read by the disk measurement
    need_bytes: int  # of disk, at the run's peak
    parent: Path  # where the run's directory is made
    free_bytes: int  # of disk there, before the run


def size_run(a: argparse.Namespace) -> RunSize:
    """The shape (a preset's, or one sized to --ram-multiple x RAM), its state, and the disk the
    run needs: the state with slack and spare files, or the disk measurement's files if more."""
    ram = mem_total_bytes()
    formats = StateBytes.for_compute(a.optimizer_state, a.master, DType(a.dtype))
    bpp = state_bytes_per_param(a.dtype, formats)
    target = a.dry_run_params or math.ceil(a.ram_multiple * ram / bpp)
    try:
        args = get_preset(a.preset) if a.preset else llama_shape(target, a.seq_len)
    except ValueError as e:
        sys.exit(str(e))
    params = args.param_count()
    state = int(params * bpp)
    bench_bytes = (
        parse_bytes(a.disk_bench_size, "--disk-bench-size")
        if a.disk_bench_size
        else min(4 << 30, max(256 * MiB, state // 16)) // MiB * MiB
    )
    train_need = int(a.disk_slack * state) + min(SPARE_BYTES, state)
    # the bench's files are gone before training
    need = max(train_need, BENCH_FOOTPRINT * bench_bytes)
    parent = Path(a.path or ".").resolve()
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    return RunSize(ram, formats, bpp, args, params, state, bench_bytes, need, parent, free)


def say_size(log: Console, size: RunSize) -> None:
    args, state, ram, need = size.args, size.state_bytes, size.ram_bytes, size.need_bytes
    spares = min(SPARE_BYTES, state)
    log.print(
        f"model: dim {args.dim} x {args.n_layers} layers, {size.params / 1e9:.3f}B params; "
        f"training state {state / GB:.1f} GB ({size.bytes_per_param:.2f} B/param: "
        f"{size.formats.describe()}) = {state / ram:.2f}x RAM ({ram / GB:.1f} GB); "
        f"disk needed: {need / GB:.1f} GB ({(need - spares) / state:.2f}x state + "
        f"{spares / GB:.1f} GB of spare chunk files), {size.free_bytes / GB:.1f} GB free under "
        f"{size.parent}",
        highlight=False,
    )


# -- the run -------------------------------------------------------------------------------------


def nvme_bytes(stats: dict[str, Any]) -> tuple[int, int]:
    """(read, written) NVMe bytes from the engine's `bytes_<src>-><dst>` counters."""
    read = sum(v for k, v in stats.items() if k.startswith("bytes_nvme->"))
    written = sum(v for k, v in stats.items() if k.startswith("bytes_") and k.endswith("->nvme"))
    return int(read), int(written)


def train(
    engine: Engine,
    data: TokenBatches,
    steps: int,
    watch: RssWatch,
    disk: dict[str, Any],
    params: int,
    log: Console,
) -> list[dict[str, Any]]:
    """`steps` training steps; per step the engine's counters, OS counters and the I/O bounds."""
    pools = (engine.parts.tiers.host_pool, engine.parts.tiers.device_pool)
    rows = []
    for step in range(1, steps + 1):
        batch = data.next_batch()
        for pool in pools:
            pool.reset_peak()  # the engine's peak_* are since open(); make them per step
        io0 = proc_io()
        with watch.phase(f"step {step}"):
            t0 = time.perf_counter()
            loss = engine.train_step(batch)
            seconds = time.perf_counter() - t0
        io1 = proc_io()
        stats = engine.stats()
        read, written = nvme_bytes(stats)
        read_s, write_s = read / (disk["read_gbps"] * GB), written / (disk["write_gbps"] * GB)
        row = {
            "step": step,
            "loss": loss,
            "seconds": seconds,
            "stats": stats,
            "nvme_read_bytes": read,
            "nvme_written_bytes": written,
            "nvme_bytes_per_param": (read + written) / params,
            "os_read_bytes": io1["read_bytes"] - io0["read_bytes"],
            "os_write_bytes": io1["write_bytes"] - io0["write_bytes"],
            "io_wait_share": stats.get("io_wait_s", float("nan")) / seconds,
            # the optimizer's compute (the compact step, on its own thread): busy_s/optimizer
            "optimizer_share": stats.get("busy_s/optimizer", float("nan")) / seconds,
            "bound_serial_s": read_s + write_s,
            "bound_overlapped_s": max(read_s, write_s),
            "peak_rss_bytes": watch.hwm[f"step {step}"],
            "peak_rss_sampled_bytes": watch.sampled[f"step {step}"],
        }
        row["ratio_serial"] = seconds / row["bound_serial_s"] if read + written else None
        row["ratio_overlapped"] = seconds / row["bound_overlapped_s"] if read + written else None
        rows.append(row)
        log.print(
            f"step {step}: loss {loss:.4f}, {seconds:.1f} s, nvme read {read / GB:.2f} GB, "
            f"written {written / GB:.2f} GB, I/O wait {row['io_wait_share']:.0%}, "
            f"optimizer {row['optimizer_share']:.1%} of the step, "
            f"peak RSS {row['peak_rss_bytes'] / GB:.2f} GB",
            highlight=False,
        )
    return rows


@dataclass
class Measured:
    """What the run measured: the disk and CPU first, then materialising and every step."""

    disk: dict[str, Any]
    estimate: Estimate
    bench_s: float  # measuring the disk and the CPU
    materialise_s: float
    state_bytes: int  # padded shards, as stored
    steps: list[dict[str, Any]]
    notes: list[str]  # the engine's
    host_budget_bytes: int
    gpu_budget_bytes: int
    device: str
    watch: RssWatch


def run(a: argparse.Namespace, size: RunSize, log: Console) -> Measured:
    """Measure the disk and the CPU, then materialise the model and train it, all under a fresh
    directory inside --path that is removed at the end, also after an error or Ctrl-C; a run
    the engine refuses exits with status 2."""
    root = Path(tempfile.mkdtemp(prefix="tierzero-ooc-", dir=size.parent))
    watch = RssWatch(size.parent)
    engine: Engine | None = None
    try:
        watch.start()
        cfg = Config(
            offload="nvme",
            nvme_path=[str(root / "nvme")],
            host_budget=int(a.host_fraction * size.ram_bytes),
            dtype=a.dtype,
            prefetch_depth=a.prefetch_depth,
            lr=a.lr,
            lr_schedule="constant",
            total_steps=a.steps,
            optimizer_state=a.optimizer_state,
            master=a.master,
        )
        try:  # checks the budgets and the disk; allocates and writes nothing yet
            engine = Engine(models.build(size.args, device="meta"), cfg)
        except ConfigError as e:
            log.print(f"the engine refused this run: {e}", highlight=False)
            sys.exit(2)
        t0 = time.perf_counter()
        disk, est = measure_first(a, size, root, cfg.streaming.io_threads, watch, log)
        bench_s = time.perf_counter() - t0
        materialise_s, state_bytes = materialise(engine, watch, size.bytes_per_param, log)
        data = TokenBatches(default_corpus(), a.batch_size, a.seq_len, seed=0)
        steps = train(engine, data, a.steps, watch, disk, size.params, log)
        watch.combine("training", [f"step {x['step']}" for x in steps])
        measured = Measured(
            disk=disk,
            estimate=est,
            bench_s=bench_s,
            materialise_s=materialise_s,
            state_bytes=state_bytes,
            steps=steps,
            notes=engine.notes(),
            host_budget_bytes=cfg.tiering.host_budget,
            gpu_budget_bytes=engine.parts.tiers.gpu_budget,
            device=engine.device.type,
            watch=watch,
        )
    except KeyboardInterrupt:
        log.print(f"interrupted: removing {root}")
        raise SystemExit(130) from None
    finally:
        try:
            if engine is not None:
                engine.close()
        finally:
            watch.stop()
            shutil.rmtree(root, ignore_errors=True)
    return measured


def measure_first(
    a: argparse.Namespace,
    size: RunSize,
    root: Path,
    io_threads: int,
    watch: RssWatch,
    log: Console,
) -> tuple[dict[str, Any], Estimate]:
    """The drive's store bandwidth under `root`, this CPU's matmul and AdamW rates, and from
    them what the run should take (said before it starts)."""
    log.print(
        f"measuring the disk under {root} ({size.bench_bytes / GB:.2f} GB, written about 8x, "
        "read 2x) and this CPU's matmul and AdamW rates ...",
        highlight=False,
    )
    with watch.phase("disk measurement"):
        disk = measure_disk(root, size.bench_bytes, io_threads)
    est = estimate(
        size.params,
        size.state_bytes,
        2 if a.dtype == "bf16" else 4,
        a.batch_size * a.seq_len,
        a.steps,
        disk,
        torch.bfloat16 if a.dtype == "bf16" else torch.float32,
        size.formats,
    )
    log.print(
        f"disk: store read {disk['read_gbps']:.2f} GB/s, write {disk['write_gbps']:.2f} GB/s; "
        f"CPU: matmul {est.matmul_tflops * 1e3:.0f} GFLOP/s, "
        f"AdamW {est.adam_params_per_s / 1e6:.0f}M params/s. "
        f"Expect about {est.total_s / 60:.1f} min: materialise {est.materialise_s:.0f} s, "
        f"then {a.steps} steps of up to {est.step_s:.0f} s.",
        highlight=False,
    )
    return disk, est


def materialise(
    engine: Engine, watch: RssWatch, bytes_per_param: float, log: Console
) -> tuple[float, int]:
    """Open the engine: every weight drawn and the whole state written; the seconds it took
    and the state's bytes as stored (padded shards)."""
    with watch.phase("materialise"):
        t0 = time.perf_counter()
        engine.open()
        seconds = time.perf_counter() - t0
    engine.stats()  # start the step counters from zero
    state_bytes = int(sum(u.shard_numel for u in engine.units) * bytes_per_param)
    log.print(
        f"materialised {state_bytes / GB:.1f} GB of state in {seconds:.1f} s", highlight=False
    )
    return seconds, state_bytes


# -- the report ----------------------------------------------------------------------------------


def step_summary(steps: list[dict[str, Any]], params: int) -> dict[str, Any]:
    """The steps' medians, and the median step's ratio to each I/O bound."""

    def median(key: str) -> float:
        return statistics.median(x[key] for x in steps)

    summary = {
        k: median(k)
        for k in (
            "nvme_bytes_per_param",
            "io_wait_share",
            "optimizer_share",
            "bound_serial_s",
            "bound_overlapped_s",
        )
    }
    summary["step_s"] = median("seconds")
    summary["read_per_param"] = median("nvme_read_bytes") / params
    summary["write_per_param"] = median("nvme_written_bytes") / params
    summary["ratio_serial"] = (
        summary["step_s"] / summary["bound_serial_s"] if summary["bound_serial_s"] else None
    )
    summary["ratio_overlapped"] = (
        summary["step_s"] / summary["bound_overlapped_s"] if summary["bound_overlapped_s"] else None
    )
    return summary


def build_report(
    a: argparse.Namespace, size: RunSize, m: Measured, started: float
) -> dict[str, Any]:
    """The run as one record: what `--json` prints and `print_report` lays out."""
    return {
        "model": asdict(size.args),
        "params": size.params,
        "dtype": a.dtype,
        "state_bytes": m.state_bytes,
        "state_bytes_per_param": size.bytes_per_param,
        "formats": size.formats.describe(),
        "device": m.device,
        "disk_peak_bytes": m.watch.disk_peak,
        "machine": {
            "ram_bytes": size.ram_bytes,
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "host_fraction": a.host_fraction,
        "host_budget_bytes": m.host_budget_bytes,
        "gpu_budget_bytes": m.gpu_budget_bytes,
        "path": str(size.parent),
        "disk": {**m.disk, "free_bytes": size.free_bytes, "need_bytes": size.need_bytes},
        "batch": {
            "batch_size": a.batch_size,
            "seq_len": a.seq_len,
            "prefetch_depth": a.prefetch_depth,
        },
        "materialise_s": m.materialise_s,
        "bench_s": m.bench_s,
        "estimate": asdict(m.estimate),
        "run_s": m.materialise_s + sum(x["seconds"] for x in m.steps),
        "rss": {
            "hwm": m.watch.hwm,
            "sampled": m.watch.sampled,
            "start": m.watch.at_start,
            "hwm_resettable": m.watch.hwm_resettable,
        },
        "steps": m.steps,
        "summary": step_summary(m.steps, size.params),
        "notes": m.notes,
        "wall_s": time.perf_counter() - started,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--path",
        default=None,
        help="directory on the drive to train on (a fresh directory is made inside it and "
        "removed at the end; default: the current directory)",
    )
    p.add_argument("--steps", type=int, default=3, help="training steps")
    p.add_argument("--ram-multiple", type=float, default=1.5, help="training state / RAM, at least")
    p.add_argument("--host-fraction", type=float, default=0.25, help="host budget / RAM")
    p.add_argument("--disk-slack", type=float, default=DISK_SLACK, help="disk / state asked")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype")
    p.add_argument(
        "--optimizer-state",
        choices=("fp32", "bf16", "int8"),
        default="fp32",
        help="the Adam moments' stored format",
    )
    p.add_argument(
        "--master", choices=("fp32", "bf16"), default="fp32", help="the master weights' dtype"
    )
    p.add_argument(
        "--preset", default=None, help="train this preset's shape (e.g. 7b) instead of sizing one"
    )
    p.add_argument(
        "--dry-run-params",
        type=int,
        default=None,
        help="build a model of about N params instead (a quick check of the same code)",
    )
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument(
        "--lr",
        type=float,
        default=1e-4,
        help="AdamW, constant learning rate (1e-3 makes a 2B model's loss climb in its first "
        "steps)",
    )
    p.add_argument(
        "--disk-bench-size",
        default=None,
        help="bytes of the disk measurement (default: state / 16, within 256 MiB..4 GiB)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    a = p.parse_args()
    if a.steps < 1 or a.ram_multiple <= 0 or not 0 < a.host_fraction <= 1:
        p.error("--steps must be >= 1, --ram-multiple > 0 and --host-fraction in (0, 1]")
    return a


def main() -> None:
    a = parse_args()
    out = Console(width=220)
    log = Console(stderr=True, width=220) if a.json else out  # progress lines; stdout stays JSON
    started = time.perf_counter()
    size = size_run(a)
    say_size(log, size)
    if size.free_bytes < size.need_bytes:
        sys.exit(
            f"{size.parent} has {size.free_bytes / GB:.1f} GB free but this run needs about "
            f"{size.need_bytes / GB:.1f} GB; free space, pass another --path, or lower "
            "--ram-multiple."
        )
    report = build_report(a, size, run(a, size, log), started)
    if a.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_report(out, report)


if __name__ == "__main__":
    main()
