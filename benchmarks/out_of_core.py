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

Never run in CI. (Past 500 lines: one self-contained script, like the other benchmarks; the
probe -- `RssWatch` -- and the report would move to a module if a second
benchmark needs them.)
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
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tierzero.storage.host import HostPool
from tierzero.storage.io import IOLoop
from tierzero.storage.nvme.spares import SpareFiles

from tierzero import Config, Engine, models
from tierzero.config import DType, StateKind, parse_bytes
from tierzero.errors import ConfigError
from tierzero.models import ModelArgs
from tierzero.models.presets import get_preset
from tierzero.planning import speeds as compute_bench
from tierzero.planning.diskbench import FOOTPRINT as BENCH_FOOTPRINT
from tierzero.planning.diskbench import DiskBench
from tierzero.planning.statebytes import StateBytes
from tierzero.run.data import TokenBatches, default_corpus

VOCAB = 32000
# Widths tried in order; the first whose depth stays within dim / 100 layers (LLaMA-2 7B: 4096
# wide, 32 deep) and at least 2 is taken, so the shape stays LLaMA-like at any size.
DIMS = (256, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)
# Disk: the live state, chunk padding and generation metadata (the brief's 1.3x), plus the
# store's spare files: up to `max_bytes` idle spares and as many retired ones per directory.
DISK_SLACK = 1.3
SPARE_BYTES = 2 * inspect.signature(SpareFiles).parameters["max_bytes"].default
RSS_SAMPLE_S = 0.2
GB = 1e9
MiB = 1 << 20


# -- the machine ---------------------------------------------------------------------------------


def mem_total_bytes() -> int:
    """MemTotal from /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo: this benchmark needs Linux")


def proc_status_bytes(field: str) -> int:
    """A `Vm*` line of /proc/self/status (kB) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def proc_io() -> dict[str, int]:
    """This process's I/O counters: read_bytes / write_bytes reached a block device (O_DIRECT too)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


class RssWatch:
    """Peak resident memory per phase, from the OS.

    Two views of the same thing: VmHWM, the kernel's high-water mark, reset to the current RSS at
    each phase's start by writing 5 to /proc/self/clear_refs (Linux >= 4.0); and the largest
    VmRSS a daemon thread sampled every `RSS_SAMPLE_S` while the phase ran (it can miss a spike
    shorter than the interval; VmHWM cannot). If clear_refs is refused, VmHWM is the peak since
    the process started, and the report says so.
    """

    def __init__(self, disk: Path) -> None:
        self.disk = disk
        self.disk_used0 = shutil.disk_usage(disk).used
        self.disk_peak = 0  # the drive's used bytes above disk_used0, at most
        self.at_start: dict[str, int] = {}  # VmRSS as the phase began
        self.hwm: dict[str, int] = {}
        self.sampled: dict[str, int] = {}
        self.hwm_resettable = True
        self._phase: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self.disk_peak = max(
                self.disk_peak, shutil.disk_usage(self.disk).used - self.disk_used0
            )
            phase = self._phase
            if phase is not None:
                rss = proc_status_bytes("VmRSS")
                self.sampled[phase] = max(self.sampled.get(phase, 0), rss)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.hwm_resettable = False
        self.at_start[name] = self.sampled[name] = proc_status_bytes("VmRSS")
        self._phase = name
        try:
            yield
        finally:
            self._phase = None
            self.hwm[name] = proc_status_bytes("VmHWM")
            self.sampled[name] = max(self.sampled[name], proc_status_bytes("VmRSS"))

    def combine(self, name: str, phases: list[str]) -> None:
        """Record `name` as the span of consecutive `phases` (their peaks, the first one's start)."""
        self.at_start[name] = self.at_start[phases[0]]
        self.hwm[name] = max(self.hwm[p] for p in phases)
        self.sampled[name] = max(self.sampled[p] for p in phases)


# -- the model -----------------------------------------------------------------------------------


def state_bytes_per_param(dtype: str, formats: StateBytes) -> float:
    """param in the compute dtype (none of its own when it is the bf16 master), grad (fp32 in
    tierzero), master and both Adam moments in their stored formats."""
    itemsize = 2 if dtype == "bf16" else 4
    kinds = [k for k in StateKind if not (k is StateKind.PARAM and formats.one_weight)]
    return sum(formats.per_param(k, itemsize, grad_itemsize=4) for k in kinds)


def llama_shape(target_params: int, seq_len: int) -> ModelArgs:
    """The narrowest LLaMA-style shape in `DIMS` with at least `target_params` parameters and no
    more than max(2, dim / 100) layers: untied, vocab 32000, SwiGLU width 8/3 dim rounded up to
    256, heads of 128 (64 below dim 1024), no GQA."""
    for dim in DIMS:
        heads = dim // 128 if dim >= 1024 else dim // 64
        ffn = math.ceil(8 * dim / 3 / 256) * 256
        one = ModelArgs(
            dim=dim,
            n_layers=1,
            n_heads=heads,
            n_kv_heads=heads,
            vocab_size=VOCAB,
            ffn_dim=ffn,
            max_seq_len=max(seq_len, 2048),
        )
        block = replace(one, n_layers=2).param_count() - one.param_count()
        layers = max(2, 1 + math.ceil((target_params - one.param_count()) / block))
        if layers <= max(2, dim // 100):
            return replace(one, n_layers=layers)
    raise SystemExit(
        f"no shape up to dim {DIMS[-1]} reaches {target_params:,} params within "
        f"dim / 100 layers; ask for fewer parameters"
    )


# -- measurements before training ----------------------------------------------------------------


def measure_disk(directory: Path, nbytes: int, io_threads: int) -> dict[str, Any]:
    """The drive's store and raw GB/s: `DiskBench`'s always-run group (layout, one interleaved
    round of raw direct I/O and the store; reads are cold, of a slot written before)."""
    with (
        IOLoop(io_threads) as io_loop,
        HostPool(nbytes, alignment=4096) as pool,
        DiskBench(str(directory), nbytes, io_loop, pool, rounds=1) as disk,
    ):
        for step in disk.steps():
            if step.group == 0:
                step.run()
        return disk.result()["nvme"]


@dataclass
class Estimate:
    """What the run should take, from the state's size and the measured disk and CPU rates.

    Per step the engine reads params twice (forward, and the recompute in backward, unless its
    host cache still holds them) and master + both Adam moments once, and writes params,
    master and moments once; gradients go from backward straight to the optimizer
    (overlap_step), so they never reach the disk. Compute is 8 x params x tokens flops
    (forward, recompute, backward) at the measured matmul rate, plus the optimizer at the
    measured CPU AdamW rate; a step's estimate is compute + the serial I/O time, a ceiling,
    since the engine overlaps them. Materialising draws every weight (the measured normal_
    rate) and writes the whole state into new files, which on ext4 go at about half the speed
    of overwrites (`tierzero.storage.nvme.spares`), one unit at a time.
    """

    materialise_s: float
    step_s: float
    total_s: float
    read_bytes_per_step: int
    write_bytes_per_step: int
    matmul_tflops: float
    adam_params_per_s: float
    init_params_per_s: float


def init_params_per_s(numel: int = 1 << 22, seconds: float = 0.5) -> float:
    """Weights per second drawn by `normal_` from a seeded generator, as the models initialise."""
    buf, generator = torch.empty(numel), torch.Generator().manual_seed(0)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        buf.normal_(0.0, 0.02, generator=generator)
        best = min(best, time.perf_counter() - t0)
    return numel / best


def estimate(
    params: int,
    state_bytes: int,
    itemsize: int,
    tokens: int,
    steps: int,
    disk: dict[str, Any],
    dtype: torch.dtype,
    formats: StateBytes,
) -> Estimate:
    tflops = compute_bench.matmul_tflops(dtype, n=1024, seconds=0.5)
    adam = compute_bench.adam_params_per_s(seconds=0.5)
    init = init_params_per_s()
    read_bw, write_bw = disk["read_gbps"] * GB, disk["write_gbps"] * GB
    optimizer = sum(
        formats.per_param(k, itemsize)
        for k in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    )
    written_param = (
        0 if formats.one_weight else itemsize
    )  # else the step writes the param as its master
    read, write = (
        int(params * (2 * itemsize + optimizer)),
        int(params * (written_param + optimizer)),
    )
    step = 8 * params * tokens / (tflops * 1e12) + params / adam + read / read_bw + write / write_bw
    materialise = params / init + 2 * state_bytes / write_bw
    return Estimate(materialise, step, materialise + steps * step, read, write, tflops, adam, init)


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
    pools = (engine.tiers.host_pool, engine.tiers.device_pool)
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
            f"peak RSS {row['peak_rss_bytes'] / GB:.2f} GB",
            highlight=False,
        )
    return rows


def gb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GB:,.2f} GB"


def ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def print_report(out: Console, r: dict[str, Any]) -> None:
    a, m, d = r["model"], r["machine"], r["disk"]
    summary = Table(title="out of core: training state vs RAM", show_header=False)
    summary.add_column("what")
    summary.add_column("value")
    rows = [
        (
            "model",
            f"dim {a['dim']} x {a['n_layers']} layers, {a['n_heads']} heads, ffn {a['ffn_dim']}, "
            f"vocab {a['vocab_size']} untied; {r['params']:,} params ({r['params'] / 1e9:.3f}B)",
        ),
        (
            "training state",
            f"{gb(r['state_bytes'])} ({r['state_bytes_per_param']:.2f} B/param, "
            f"{r['dtype']} compute, {r['formats']}, every kind on NVMe) = "
            f"{r['state_bytes'] / m['ram_bytes']:.2f}x RAM",
        ),
        ("RAM (MemTotal)", gb(m["ram_bytes"])),
        ("host budget", f"{gb(r['host_budget_bytes'])} ({r['host_fraction']:.2f}x RAM)"),
        (
            "device pool budget",
            f"{gb(r['gpu_budget_bytes'])} ({r['device']}"
            + (": host memory too" if r["device"] == "cpu" else "")
            + ")",
        ),
        (
            "disk",
            f"{r['path']}: {gb(d['free_bytes'])} free, this run needs {gb(d['need_bytes'])}; "
            f"used at its peak {gb(r['disk_peak_bytes'])}",
        ),
        (
            "disk bandwidth (store)",
            f"read {d['read_gbps']:.2f} GB/s, write {d['write_gbps']:.2f} GB/s "
            f"({d['bytes'] / GB:.2f} GB, direct I/O {d['direct_io']}; raw direct "
            f"I/O read {d['raw_read_gbps']:.2f}, write {d['raw_write_gbps']:.2f})",
        ),
        (
            "materialise",
            f"{r['materialise_s']:.1f} s ({r['state_bytes'] / r['materialise_s'] / GB:.2f} GB/s "
            f"of state written)",
        ),
    ]
    rss = r["rss"]
    for phase in ("disk measurement", "materialise", "training"):
        rows.append(
            (
                f"peak RSS, {phase}",
                f"VmHWM {gb(rss['hwm'][phase])}, sampled VmRSS max "
                f"{gb(rss['sampled'][phase])} (VmRSS at its start "
                f"{gb(rss['start'][phase])})",
            )
        )
    peak, host, device = rss["hwm"]["training"], r["host_budget_bytes"], r["gpu_budget_bytes"]
    rows.append(
        (
            "peak RSS, training / budgets",
            f"{peak / host:.2f}x the host budget"
            + (
                f", {peak / (host + device):.2f}x host + device pool budgets"
                if r["device"] == "cpu"
                else ""
            ),
        )
    )
    s = r["summary"]
    rows += [
        ("step time (median)", f"{s['step_s']:.1f} s"),
        (
            "NVMe bytes / param / step",
            f"{s['nvme_bytes_per_param']:.1f} (read {s['read_per_param']:.1f}, "
            f"written {s['write_per_param']:.1f})",
        ),
        ("I/O wait share", f"{s['io_wait_share']:.0%} (engine's io_wait_s)"),
        (
            "I/O bound serial / overlapped",
            f"{s['bound_serial_s']:.1f} s / {s['bound_overlapped_s']:.1f} s",
        ),
        (
            "step / bound",
            f"{ratio(s['ratio_serial'])} serial, {ratio(s['ratio_overlapped'])} overlapped",
        ),
        ("loss", " -> ".join(f"{x['loss']:.3f}" for x in r["steps"])),
        (
            "time",
            f"materialise + steps {r['run_s'] / 60:.1f} min (estimated {r['estimate']['total_s'] / 60:.1f} "
            f"min); measuring first {r['bench_s']:.0f} s; {r['wall_s'] / 60:.1f} min in all",
        ),
    ]
    for k, v in rows:
        summary.add_row(k, v)
    out.print(summary)

    # one column per step, one row per measure: the engine's counters are whatever it reports
    keys = sorted({k for x in r["steps"] for k in x["stats"] if k.startswith(("bytes_", "peak_"))})
    table = Table(title="per step (engine counters as `engine.stats()` names them; OS: /proc/self)")
    table.add_column("measure")
    for x in r["steps"]:
        table.add_column(f"step {x['step']}", justify="right")
    measures = [("loss", lambda x: f"{x['loss']:.4f}"), ("time", lambda x: f"{x['seconds']:.1f} s")]
    measures += [(k, lambda x, k=k: gb(x["stats"].get(k))) for k in keys]
    measures += [
        ("OS read_bytes (/proc/self/io)", lambda x: gb(x["os_read_bytes"])),
        ("OS write_bytes (/proc/self/io)", lambda x: gb(x["os_write_bytes"])),
        ("NVMe bytes / param", lambda x: f"{x['nvme_bytes_per_param']:.1f}"),
        ("I/O wait (io_wait_s / step)", lambda x: f"{x['io_wait_share']:.0%}"),
        (
            "peak RSS: VmHWM / sampled",
            lambda x: f"{gb(x['peak_rss_bytes'])} / {gb(x['peak_rss_sampled_bytes'])}",
        ),
        ("I/O bound serial", lambda x: f"{x['bound_serial_s']:.2f} s"),
        ("step / serial bound", lambda x: ratio(x["ratio_serial"])),
        ("I/O bound overlapped", lambda x: f"{x['bound_overlapped_s']:.2f} s"),
        ("step / overlapped bound", lambda x: ratio(x["ratio_overlapped"])),
    ]
    for name, cell in measures:
        table.add_row(name, *(cell(x) for x in r["steps"]))
    out.print(table)
    if not r["rss"]["hwm_resettable"]:
        out.print(
            "note: /proc/self/clear_refs was refused, so every VmHWM is the peak since the process started"
        )
    for note in r["notes"]:
        out.print(f"note (engine): {note}", highlight=False)


def main() -> None:
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
        help="AdamW, constant learning rate (1e-3 makes a 2B model's loss climb in its first steps)",
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
    out = Console(width=220)
    log = Console(stderr=True, width=220) if a.json else out  # progress lines; stdout stays JSON
    started = time.perf_counter()

    ram = mem_total_bytes()
    formats = StateBytes.for_compute(a.optimizer_state, a.master, DType(a.dtype))
    bpp = state_bytes_per_param(a.dtype, formats)
    target = a.dry_run_params or math.ceil(a.ram_multiple * ram / bpp)
    args = get_preset(a.preset) if a.preset else llama_shape(target, a.seq_len)
    params = args.param_count()
    state = int(params * bpp)
    bench_bytes = (
        parse_bytes(a.disk_bench_size, "--disk-bench-size")
        if a.disk_bench_size
        else min(4 << 30, max(256 * MiB, state // 16)) // MiB * MiB
    )
    train_need = int(DISK_SLACK * state) + min(SPARE_BYTES, state)
    need = max(
        train_need, BENCH_FOOTPRINT * bench_bytes
    )  # the bench's files are gone before training
    parent = Path(a.path or ".").resolve()
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    log.print(
        f"model: dim {args.dim} x {args.n_layers} layers, {params / 1e9:.3f}B params; training state "
        f"{state / GB:.1f} GB ({bpp:.2f} B/param: {formats.describe()}) = {state / ram:.2f}x RAM ({ram / GB:.1f} GB); "
        f"disk needed: {need / GB:.1f} GB ({DISK_SLACK}x state + {min(SPARE_BYTES, state) / GB:.1f} GB "
        f"of spare chunk files), {free / GB:.1f} GB free under {parent}",
        highlight=False,
    )
    if free < need:
        sys.exit(
            f"{parent} has {free / GB:.1f} GB free but this run needs about {need / GB:.1f} GB; "
            "free space, pass another --path, or lower --ram-multiple."
        )

    root = Path(tempfile.mkdtemp(prefix="tierzero-ooc-", dir=parent))
    watch = RssWatch(parent)
    engine: Engine | None = None
    try:
        watch.start()
        cfg = Config(
            offload="nvme",
            nvme_path=[str(root / "nvme")],
            host_budget=int(a.host_fraction * ram),
            dtype=a.dtype,
            prefetch_depth=a.prefetch_depth,
            lr=a.lr,
            lr_schedule="constant",
            total_steps=a.steps,
            optimizer_state=a.optimizer_state,
            master=a.master,
        )
        try:  # checks the budgets and the disk; allocates and writes nothing yet
            engine = Engine(models.build(args, device="meta"), cfg)
        except ConfigError as e:
            log.print(f"the engine refused this run: {e}", highlight=False)
            sys.exit(2)
        log.print(
            f"measuring the disk under {root} ({bench_bytes / GB:.2f} GB, written about 8x, read 2x) "
            "and this CPU's matmul and AdamW rates ...",
            highlight=False,
        )
        t0 = time.perf_counter()
        with watch.phase("disk measurement"):
            disk = measure_disk(root, bench_bytes, cfg.io_threads)
        compute_dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
        est = estimate(
            params,
            state,
            2 if a.dtype == "bf16" else 4,
            a.batch_size * a.seq_len,
            a.steps,
            disk,
            compute_dtype,
            formats,
        )
        bench_s = time.perf_counter() - t0
        log.print(
            f"disk: store read {disk['read_gbps']:.2f} GB/s, write {disk['write_gbps']:.2f} GB/s; CPU: "
            f"matmul {est.matmul_tflops * 1e3:.0f} GFLOP/s, AdamW {est.adam_params_per_s / 1e6:.0f}M "
            f"params/s. Expect about {est.total_s / 60:.1f} min: materialise {est.materialise_s:.0f} s, "
            f"then {a.steps} steps of up to {est.step_s:.0f} s.",
            highlight=False,
        )

        with watch.phase("materialise"):
            t0 = time.perf_counter()
            engine.open()
            materialise_s = time.perf_counter() - t0
        engine.stats()  # start the step counters from zero
        state_bytes = int(
            sum(u.shard_numel for u in engine.units) * bpp
        )  # padded shards, as stored
        log.print(
            f"materialised {state_bytes / GB:.1f} GB of state in {materialise_s:.1f} s",
            highlight=False,
        )
        data = TokenBatches(default_corpus(), a.batch_size, a.seq_len, seed=0)
        steps = train(engine, data, a.steps, watch, disk, params, log)
        watch.combine("training", [f"step {x['step']}" for x in steps])
        notes = engine.notes()
        gpu_budget = engine.tiers.gpu_budget
        device = engine.device.type
    except KeyboardInterrupt:
        log.print(f"interrupted: removing {root}")
        raise SystemExit(130)
    finally:
        try:
            if engine is not None:
                engine.close()
        finally:
            watch.stop()
            shutil.rmtree(root, ignore_errors=True)

    def median(key: str) -> float:
        return statistics.median(x[key] for x in steps)

    summary = {
        k: median(k)
        for k in ("nvme_bytes_per_param", "io_wait_share", "bound_serial_s", "bound_overlapped_s")
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
    report = {
        "model": asdict(args),
        "params": params,
        "dtype": a.dtype,
        "state_bytes": state_bytes,
        "state_bytes_per_param": bpp,
        "formats": formats.describe(),
        "device": device,
        "disk_peak_bytes": watch.disk_peak,
        "machine": {
            "ram_bytes": ram,
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "host_fraction": a.host_fraction,
        "host_budget_bytes": cfg.host_budget,
        "gpu_budget_bytes": gpu_budget,
        "path": str(parent),
        "disk": {**disk, "free_bytes": free, "need_bytes": need},
        "batch": {
            "batch_size": a.batch_size,
            "seq_len": a.seq_len,
            "prefetch_depth": a.prefetch_depth,
        },
        "materialise_s": materialise_s,
        "bench_s": bench_s,
        "estimate": asdict(est),
        "run_s": materialise_s + sum(x["seconds"] for x in steps),
        "rss": {
            "hwm": watch.hwm,
            "sampled": watch.sampled,
            "start": watch.at_start,
            "hwm_resettable": watch.hwm_resettable,
        },
        "steps": steps,
        "summary": summary,
        "notes": notes,
        "wall_s": time.perf_counter() - started,
    }
    if a.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_report(out, report)


if __name__ == "__main__":
    main()
