"""One GPU for real: train the largest preset this machine can hold, on a 24 GiB-sized GPU.

For a machine with a CUDA GPU (never run in CI). It caps the memory torch may use on the GPU to
`--gpu-mem` (default 24 GiB, a workstation card; `torch.cuda.set_per_process_memory_fraction`),
measures in the same run the GPU's bf16 matmul peak, pinned host<->GPU copy bandwidth in each
direction, the drive's store read/write bandwidth and CPU AdamW throughput, then picks the
largest preset whose state fits the free disk under `--path` and the free RAM (the one memory
model, `tierzero.planning.memory_model`), and trains it in bf16 with params and optimizer offloaded: every
state kind on the host (`host`), then every state kind on NVMe (`nvme`). Per placement it prints

- step time, tokens/s, model TFLOPS = 6 N tokens / s and hardware TFLOPS = 8 N tokens / s
  (per-unit checkpointing recomputes each forward once in backward: 2 N more), and each one's
  ratio to the measured bf16 peak;
- H2D and D2H GB/s achieved (the engine's byte counters / step time) and the measured peaks;
- NVMe GB/s achieved and the I/O wait share (the training thread's `io_wait_s` / step time);
- the bound of a step: max(compute = 8 N tokens / peak, H2D bytes / H2D peak, D2H bytes / D2H
  peak, NVMe read / read peak + NVMe write / write peak, N / CPU AdamW rate), which term it is,
  and the step's ratio to it;
- `cudaHostRegister` calls per timed step (pinning on the hot path costs; should be 0).

It writes a `torch.profiler` trace of one micro-batch (of a vertical step: the whole step) of
each placement, run after the timed steps and not among them (`--trace-dir`), and the figures as JSON with `--json`. Tokens per
step: `--micro-batch` sequences of `--seq-len` (by default the largest micro-batch up to 64
whose activations fit) times the fewest micro-batches that bring the bound per token near what
accumulation can reach at the measured rates (at most `--max-accumulate`). A larger micro-batch
is preferred over accumulation, which runs layer-major (`--schedule vertical`: params move
twice per step whatever the count, but each micro-batch's block inputs wait in host memory).

    python benchmarks/gpu.py --path /mnt/nvme/tz              # ~15-30 min on an 8B-class run
    python benchmarks/gpu.py --dry-run                        # anywhere: the choice, the bound

`--quick` is the first-run check for one H200 (16 cores, 128 GB RAM, 64 GB disk), under 6
minutes: short peak measurements with a 1 GiB disk probe, the CUDA tests (`pytest -m cuda`,
time-limited), and the `1b` preset trained a few steps per placement on the whole GPU, writing
`table.txt`, `results.json`, `pytest-cuda.txt` and a profiler trace per placement to `--out`.
`--quick --dry-run` prints that plan, each stage's budget and each placement's bound, anywhere.

    python benchmarks/gpu.py --quick --path /mnt/nvme/tz --out gpu-quick   # on the GPU machine; or
    python benchmarks/gpu.py --quick --dry-run                             # anywhere

Without CUDA, or without `--path` (the NVMe directory: tens of GiB, direct I/O), and without
--dry-run, it refuses in one sentence, exit 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tierzero import Config, Engine, Placement, Tier, models
from tierzero.config import Schedule, parse_bytes
from tierzero.planning.ledger import activation_memory
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.peaks import MemoryModel
from tierzero.planning.workload import Workload
from tierzero.models import ModelArgs
from tierzero.models.presets import PRESETS
from tierzero.planning.machine import available_host_bytes

PLACEMENTS = {
    "host": Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST),
    "nvme": Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME),
}
COMPUTE_ITEMSIZE = 2  # bf16
PREFETCH_DEPTH = 2


@dataclass(frozen=True)
class Machine:
    """What the run may use: the capped GPU, a share of the free RAM, the free disk."""

    gpu_bytes: int
    host_bytes: int
    disk_bytes: int


@dataclass(frozen=True)
class Rates:
    """Peaks measured in the same run (or nominal ones for --dry-run)."""

    bf16_tflops: float
    h2d_gbps: float
    d2h_gbps: float
    nvme_read_gbps: float
    nvme_write_gbps: float
    adam_params_per_s: float


# An H200-class machine's rough figures, only for --dry-run's arithmetic (never reported as measured).
NOMINAL = Rates(bf16_tflops=700.0, h2d_gbps=50.0, d2h_gbps=50.0, nvme_read_gbps=6.0,
                nvme_write_gbps=4.0, adam_params_per_s=1.5e9)



@dataclass(frozen=True)
class Quick:
    """`--quick`'s plan: fixed sizes, so a first GPU run fits its budget (seconds per stage; the
    CUDA tests are killed at theirs)."""

    preset: str = "1b"
    seq_len: int = 2048
    largest_micro_batch: int = 16
    # accumulation runs layer-major (vertical): params cross each link twice per step whatever k
    max_accumulate: tuple[tuple[str, int], ...] = (("host", 8), ("nvme", 4))
    steps: int = 2  # timed, after one warm-up step
    disk_probe_bytes: int = 1 << 30
    budget_s: tuple[tuple[str, int], ...] = (("peaks and 1 GiB disk probe", 30), ("pytest -m cuda", 150),
                                             ("train host", 60), ("train nvme", 110))


def quick_plan(quick: Quick, machine: Machine, rates: Rates) -> list[str]:
    """What `--quick` will do, each stage's time budget, and the predicted step bound per placement."""
    args = PRESETS[quick.preset]
    micro = pick_micro_batch(args, machine, quick.seq_len, quick.largest_micro_batch)
    lines = [*(f"{name}: at most {limit} s" for name, limit in quick.budget_s),
             f"in all: at most {sum(limit for _, limit in quick.budget_s)} s"]
    for name in PLACEMENTS:
        acc = pick_accumulation(args, name, micro * quick.seq_len, rates, dict(quick.max_accumulate)[name])
        traffic = step_traffic(args, name, acc, schedule_for(acc), micro * quick.seq_len)
        b = bound(n := args.param_count(), tokens := micro * quick.seq_len * acc, traffic, rates)
        lines.append(f"{name}: {quick.preset}, {micro} x {quick.seq_len} x {acc} tokens, {quick.steps} timed steps; bound "
                     f"{b['bound_s']:.2f} s ({b['bound_by']}), model TFLOPS there {6 * n * tokens / b['bound_s'] / 1e12:.0f}"
                     f" of peak {rates.bf16_tflops:.0f}")
    return lines


def run_cuda_tests(out: Path, timeout_s: int) -> int:
    """`pytest -m cuda` in a child process killed at `timeout_s`, its output in `out`; its exit code (124: killed)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
    with out.open("w") as log:
        try:
            return subprocess.run(cmd, cwd=Path(__file__).parents[1], stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\ntimed out after {timeout_s} s\n")
            return 124


# -- the choice of preset, micro-batch and tokens per step (no GPU needed) -------------------------

def memory(args: ModelArgs, placement: Placement, micro_batch: int, seq_len: int) -> MemoryModel:
    """The engine's own memory model for this preset, placement and micro-batch."""
    return peak_memory(Workload.from_preset(args, COMPUTE_ITEMSIZE, device="cuda", prefetch_depth=PREFETCH_DEPTH,
                                            overlap=True,
                                            activations=activation_memory(args, micro_batch, seq_len, COMPUTE_ITEMSIZE)),
                       placement)


def fits(mem: MemoryModel, machine: Machine) -> bool:
    needs = mem.needs()
    return (needs[Tier.GPU] <= machine.gpu_bytes and needs[Tier.HOST] <= machine.host_bytes
            and needs[Tier.NVME] <= machine.disk_bytes)


def pick_preset(machine: Machine, seq_len: int) -> str | None:
    """The largest preset (by parameters) that fits in *both* placements at micro-batch 1."""
    for name in sorted(PRESETS, key=lambda n: PRESETS[n].param_count(), reverse=True):
        args = PRESETS[name]
        if all(fits(memory(args, p, 1, min(seq_len, args.max_seq_len)), machine) for p in PLACEMENTS.values()):
            return name
    return None


def pick_micro_batch(args: ModelArgs, machine: Machine, seq_len: int, largest: int = 64) -> int:
    """The largest power-of-two micro-batch up to `largest` whose activations fit (at least 1)."""
    best = 1
    while best * 2 <= largest and all(fits(memory(args, p, best * 2, seq_len), machine) for p in PLACEMENTS.values()):
        best *= 2
    return best


def schedule_for(accumulate: int) -> Schedule:
    """The benchmark accumulates layer-major: horizontal would move every param again per micro-batch."""
    return Schedule.VERTICAL if accumulate > 1 else Schedule.HORIZONTAL


def step_traffic(args: ModelArgs, placement: str, accumulate: int = 1, schedule: Schedule = Schedule.HORIZONTAL,
                 micro_tokens: int = 0) -> dict[str, int]:
    """Bytes one step of `accumulate` micro-batches moves, by link, with overlap_step (the last
    micro-batch's grads go straight to the optimizer). Horizontal: every micro-batch fetches
    every param twice (forward, recompute in backward) and sends its fp32 grads to the host;
    each after the first brings the earlier micro-batches' sums back to add them on the GPU.
    Vertical: each unit's params come twice per step and its grad, summed on the GPU, goes
    once; each micro-batch's input to every block (`micro_tokens` x dim) waits in host memory
    between the passes (out and back). With nvme homes the params are read twice per pass (an
    upper bound: the host's param cache saves some reads) and written once, the optimizer reads
    and writes master and both moments, and horizontally the grad sums of all but the last
    micro-batch are written, and of all but the first read."""
    n = args.param_count()
    passes, sums = (1, 0) if schedule == Schedule.VERTICAL else (accumulate, accumulate - 1)
    params = 2 * n * COMPUTE_ITEMSIZE
    waiting = (accumulate * args.n_layers * micro_tokens * args.dim * COMPUTE_ITEMSIZE
               if schedule == Schedule.VERTICAL else 0)
    out = {"h2d": passes * params + sums * n * 4 + waiting, "d2h": passes * n * 4 + waiting,
           "nvme_read": 0, "nvme_write": 0}
    if placement == "nvme":
        out["nvme_read"] = passes * params + 3 * n * 4 + sums * n * 4
        out["nvme_write"] = n * COMPUTE_ITEMSIZE + 3 * n * 4 + sums * n * 4
    return out


def bound(n_params: int, tokens: int, traffic: dict[str, int], rates: Rates) -> dict[str, float]:
    """Seconds each resource needs for one step, and the bound: the largest of them.

    compute counts the recompute (8 N flops per token). NVMe reads and writes share the drive,
    so their times add."""
    terms = {
        "compute": 8 * n_params * tokens / (rates.bf16_tflops * 1e12),
        "h2d": traffic["h2d"] / (rates.h2d_gbps * 1e9),
        "d2h": traffic["d2h"] / (rates.d2h_gbps * 1e9),
        "nvme": (traffic["nvme_read"] / (rates.nvme_read_gbps * 1e9)
                 + traffic["nvme_write"] / (rates.nvme_write_gbps * 1e9)),
        "cpu_adam": n_params / rates.adam_params_per_s,
    }
    limit = max(terms, key=terms.get)
    return {**terms, "bound_s": terms[limit], "bound_by": limit}  # type: ignore[dict-item]


def pick_accumulation(args: ModelArgs, placement: str, micro_tokens: int, rates: Rates, most: int) -> int:
    """Micro-batches per step: the fewest (at most `most`) whose bound per token is within 10%
    of the bound per token at `most`. Layer-major accumulation amortises what a step moves once
    (params twice, grads, the optimizer's states, CPU AdamW); the waiting activations grow with
    every micro-batch as compute does, so where they outrun compute only a larger micro-batch helps."""
    n = args.param_count()

    def per_token(accumulate: int) -> float:
        tokens = micro_tokens * accumulate
        traffic = step_traffic(args, placement, accumulate, schedule_for(accumulate), micro_tokens)
        return bound(n, tokens, traffic, rates)["bound_s"] / tokens

    limit = per_token(most)
    return next(a for a in range(1, most + 1) if per_token(a) <= 1.1 * limit)


# -- the report ------------------------------------------------------------------------------------

def report_row(name: str, args: ModelArgs, tokens: int, step_s: float, stats: dict[str, float],
               rates: Rates, registrations_per_step: float) -> dict[str, Any]:
    """One placement's figures from its median step time and one step's engine counters."""
    n = args.param_count()
    traffic = {"h2d": int(stats.get("bytes_host->gpu", 0)), "d2h": int(stats.get("bytes_gpu->host", 0)),
               "nvme_read": int(stats.get("bytes_nvme->host", 0)), "nvme_write": int(stats.get("bytes_host->nvme", 0))}
    b = bound(n, tokens, traffic, rates)
    model_tflops = 6 * n * tokens / step_s / 1e12
    hw_tflops = 8 * n * tokens / step_s / 1e12
    return {
        "placement": name, "params": n, "tokens_per_step": tokens, "step_s": step_s,
        "tokens_per_s": tokens / step_s, "model_tflops": model_tflops, "hw_tflops": hw_tflops,
        "bf16_peak_tflops": rates.bf16_tflops, "model_ratio": model_tflops / rates.bf16_tflops,
        "hw_ratio": hw_tflops / rates.bf16_tflops,
        "h2d_gbps": traffic["h2d"] / step_s / 1e9, "h2d_peak_gbps": rates.h2d_gbps,
        "d2h_gbps": traffic["d2h"] / step_s / 1e9, "d2h_peak_gbps": rates.d2h_gbps,
        "nvme_gbps": (traffic["nvme_read"] + traffic["nvme_write"]) / step_s / 1e9,
        "io_wait_share": stats.get("io_wait_s", 0.0) / step_s,
        "bound_s": b["bound_s"], "bound_by": b["bound_by"], "step_over_bound": step_s / b["bound_s"],
        "terms_s": {k: b[k] for k in ("compute", "h2d", "d2h", "nvme", "cpu_adam")},
        "host_registrations_per_step": registrations_per_step,
    }


def table_lines(rows: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The report as (figure, value per placement) rows: placements side by side."""
    def each(fmt: str) -> tuple[str, ...]:
        return tuple(fmt.format(**r) for r in rows)

    return [
        ("placement", *each("{placement}")),
        ("tokens / step", *each("{micro_batch} x {seq_len} x {accumulate} = {tokens_per_step}")),
        ("step", *each("{step_s:.2f} s")),
        ("tokens / s", *each("{tokens_per_s:,.0f}")),
        ("model TFLOPS (6N)", *each("{model_tflops:.1f} = {model_ratio:.0%} of bf16 peak {bf16_peak_tflops:.0f}")),
        ("with recompute (8N)", *each("{hw_tflops:.1f} = {hw_ratio:.0%} of peak")),
        ("H2D GB/s (peak)", *each("{h2d_gbps:.1f} ({h2d_peak_gbps:.1f})")),
        ("D2H GB/s (peak)", *each("{d2h_gbps:.1f} ({d2h_peak_gbps:.1f})")),
        ("NVMe GB/s", *each("{nvme_gbps:.2f}")),
        ("I/O wait share", *each("{io_wait_share:.0%}")),
        ("bound", *each("{bound_s:.2f} s ({bound_by})")),
        ("step / bound", *each("{step_over_bound:.2f}x")),
        ("pinning calls / step", *each("{host_registrations_per_step:.1f}")),
    ]


def print_table(preset: str, rows: list[dict[str, Any]], measured: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    how = "measured" if measured else "dry run: nominal rates, no training, step = bound"
    table = Table(title=f"{preset} ({rows[0]['params'] / 1e9:.2f}B params), bf16, one GPU ({how})")
    lines = table_lines(rows)
    for col in lines[0]:
        table.add_column(col)
    for line in lines[1:]:
        table.add_row(*line)
    Console().print(table)


# -- the GPU run -------------------------------------------------------------------------------------

def measure_rates(device: torch.device, disk_dir: Path, nbytes: int = 4 << 30, seconds: float = 1.0) -> Rates:
    from tierzero.planning import speeds as bench
    from tierzero.storage.bench import DiskBench
    from tierzero.storage.host import HostPool
    from tierzero.storage.io import IOLoop

    with torch.cuda.device(device):
        tflops = bench.matmul_tflops(torch.bfloat16, n=8192, seconds=2 * seconds, device=device)
        h2d = bench.h2d_gbps(1 << 30, seconds=seconds)
        d2h = bench.h2d_gbps(1 << 30, seconds=seconds, to_host=True)
    with IOLoop(16) as io_loop, HostPool(nbytes, pin=False) as pool, \
            DiskBench(str(disk_dir), nbytes, io_loop, pool, rounds=1) as disk:
        for step in disk.steps():
            if step.group == 0:
                step.run()
        nvme = disk.result()["nvme"]
    return Rates(tflops, h2d, d2h, nvme["read_gbps"], nvme["write_gbps"], bench.adam_params_per_s(1 << 24, seconds))


def train(name: str, args: ModelArgs, machine: Machine, device: torch.device, micro_batch: int, seq_len: int,
          accumulate: int, steps: int, workdir: Path, trace: Path) -> tuple[float, dict[str, float], float]:
    """Median step time, the last step's engine counters, pinning calls per timed step."""
    from tierzero.run.data import TokenBatches, default_corpus

    cfg = Config(placement=PLACEMENTS[name], nvme_path=[str(workdir / f"nvme-{name}")], dtype="bf16",
                 device=str(device), host_budget=machine.host_bytes, gpu_budget=machine.gpu_bytes,
                 prefetch_depth=PREFETCH_DEPTH, accumulate=accumulate, schedule=schedule_for(accumulate),
                 total_steps=steps + 2, warmup_steps=1)
    data = TokenBatches(default_corpus(64 << 20), micro_batch, seq_len, seed=0)
    times: list[float] = []
    with Engine(models.build(args, device="meta", seed=0), cfg) as engine:
        def step() -> float:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(accumulate):
                engine.train_micro_batch(data.next_batch())  # the loss is never read: no sync
            torch.cuda.synchronize(device)
            return time.perf_counter() - start

        step()  # warm-up: pools, caches and the allocator settle
        engine.stats()
        registered = engine.tiers.host_pool.registrations
        for _ in range(steps):
            times.append(step())
            stats = engine.stats()
        registrations = (engine.tiers.host_pool.registrations - registered) / steps
        # one horizontal micro-batch (not a whole step of up to --max-accumulate of them: a trace
        # of a big model's step is gigabytes), after the timed steps and not among them; a
        # vertical step runs when its last micro-batch arrives, so its trace is the whole step
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(accumulate if cfg.schedule == Schedule.VERTICAL else 1):
                engine.train_micro_batch(data.next_batch())
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(str(trace))
    return statistics.median(times), stats, registrations


# -- main ----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu-mem", default="24GiB", help="GPU memory torch may use (emulates a workstation card)")
    ap.add_argument("--host-fraction", type=float, default=0.8, help="share of the free RAM the engine may use")
    ap.add_argument("--path", default=None, help="directory on the NVMe drive (needs tens of GiB and "
                    "direct I/O; required but for --dry-run)")
    ap.add_argument("--preset", default=None, help="train this preset instead of the largest that fits")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--max-accumulate", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per placement (after one warm-up)")
    ap.add_argument("--placements", default="host,nvme")
    ap.add_argument("--trace-dir", default=".")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="no GPU needed: the choice and the bound from nominal rates")
    ap.add_argument("--quick", action="store_true", help="the first-run check in under 6 minutes (module docstring)")
    ap.add_argument("--out", default="gpu-quick", help="--quick: the directory for its table, results and traces")
    opts = ap.parse_args(argv)
    quick = Quick() if opts.quick else None
    if quick is not None:
        opts.preset, opts.seq_len, opts.steps, opts.trace_dir = quick.preset, quick.seq_len, quick.steps, opts.out
        opts.gpu_mem = "139GiB"  # the whole H200 (capped at what the GPU has): the micro-batch it allows
    if quick is not None and opts.dry_run:  # the machine it is for, not this one
        h200 = Machine(parse_bytes(opts.gpu_mem, "--gpu-mem"), int(128e9 * opts.host_fraction), int(64e9 * 0.9))
        print("\n".join(["benchmarks/gpu.py --quick, one H200 (nominal rates):", *quick_plan(quick, h200, NOMINAL)]))
        return 0

    if not opts.dry_run and not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU and none is visible here; run it on a GPU machine, "
              "or pass --dry-run to see the preset it would pick and the bound arithmetic", file=sys.stderr)
        return 2
    if not opts.dry_run and opts.path is None:
        print("benchmarks/gpu.py needs --path, a directory on the NVMe drive with tens of GiB free "
              "(its stores use direct I/O, which a tmpfs refuses); or pass --dry-run", file=sys.stderr)
        return 2
    placements = [p for p in opts.placements.split(",") if p]
    if not placements or set(placements) - set(PLACEMENTS):
        print(f"--placements takes a comma-separated subset of {', '.join(PLACEMENTS)}", file=sys.stderr)
        return 2
    gpu_cap = parse_bytes(opts.gpu_mem, "--gpu-mem")
    base = Path(opts.path) if opts.path else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="tierzero-gpu-bench-", dir=base))
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if not opts.dry_run else torch.device("cpu")
        if not opts.dry_run:
            total = torch.cuda.get_device_properties(device).total_memory
            if gpu_cap < total:
                torch.cuda.set_per_process_memory_fraction(gpu_cap / total, device)
            gpu_cap = min(gpu_cap, total)
        machine = Machine(gpu_bytes=gpu_cap, host_bytes=int(available_host_bytes() * opts.host_fraction),
                          disk_bytes=int(shutil.disk_usage(workdir).free * 0.9))
        preset = opts.preset or pick_preset(machine, opts.seq_len)
        if preset is None or preset not in PRESETS:
            print(f"no preset fits this machine ({machine}); free disk or RAM, or raise --gpu-mem", file=sys.stderr)
            return 2
        args = PRESETS[preset]
        seq_len = min(opts.seq_len, args.max_seq_len)
        micro = opts.micro_batch or pick_micro_batch(args, machine, seq_len, quick.largest_micro_batch if quick else 64)
        rates = (NOMINAL if opts.dry_run else measure_rates(device, workdir, quick.disk_probe_bytes, 0.5) if quick
                 else measure_rates(device, workdir))
        if quick is not None:
            Path(opts.out).mkdir(parents=True, exist_ok=True)
            tests_rc = run_cuda_tests(Path(opts.out) / "pytest-cuda.txt", dict(quick.budget_s)["pytest -m cuda"])
        rows = []
        for name in placements:
            most = dict(quick.max_accumulate)[name] if quick else opts.max_accumulate
            accumulate = pick_accumulation(args, name, micro * seq_len, rates, most)
            tokens = micro * seq_len * accumulate
            if opts.dry_run:  # the bound itself, as if the step ran exactly at it
                traffic = step_traffic(args, name, accumulate, schedule_for(accumulate), micro * seq_len)
                stats = {"bytes_host->gpu": traffic["h2d"], "bytes_gpu->host": traffic["d2h"],
                         "bytes_nvme->host": traffic["nvme_read"], "bytes_host->nvme": traffic["nvme_write"],
                         "io_wait_s": 0.0}
                step_s, regs = bound(args.param_count(), tokens, traffic, rates)["bound_s"], 0.0
            else:
                trace = Path(opts.trace_dir) / f"gpu-bench-{preset}-{name}.json"
                step_s, stats, regs = train(name, args, machine, device, micro, seq_len, accumulate, opts.steps,
                                            workdir, trace)
            rows.append({**report_row(name, args, tokens, step_s, stats, rates, regs),
                         "micro_batch": micro, "seq_len": seq_len, "accumulate": accumulate})
        out = {"preset": preset, "machine": asdict(machine), "rates": asdict(rates), "measured": not opts.dry_run,
               "gpu": torch.cuda.get_device_name(device) if not opts.dry_run else None, "rows": rows}
        if quick is not None:
            (Path(opts.out) / "results.json").write_text(json.dumps({**out, "cuda_tests_exit_code": tests_rc}, indent=2))
            (Path(opts.out) / "table.txt").write_text("\n".join(" | ".join(line) for line in table_lines(rows))
                                                      + f"\npytest -m cuda: exit {tests_rc}\n")
        if opts.json:
            print(json.dumps(out, indent=2))
        else:
            print_table(preset, rows, measured=not opts.dry_run)
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
