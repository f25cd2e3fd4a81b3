"""The GPU benchmark's run: measure this machine, plan each placement inside the time budget,
train it, and record every result the moment it exists (`tierzero.bench.results`).

Written for the first hour on a machine nobody has seen: it budgets from what the machine has
when each stage starts (free GPU memory, a share of MemAvailable, the work dir's free disk,
whether that disk takes O_DIRECT); a placement the planner refuses, or one that fails, is a
record with its reason or error message, and the run goes on; a watchdog ends the process at
the time budget, after recording that it did, so a run never outlives its budget and loses
nothing it measured. `device="cpu"` runs the same stages on the CPU with the `tiny` preset
(for tests, and for trying the script anywhere). Only `benchmarks/gpu.py` prints (`say`).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tierzero.bench import plan
from tierzero.bench.plan import Machine, Rates, StagePlan, Verdict
from tierzero.bench.rates import measure_rates
from tierzero.bench.results import ResultLog
from tierzero.bench.trace import analyse, load_trace, write_trace
from tierzero.models.presets import PRESETS
from tierzero.planning.machine import available_host_bytes, free_disk_bytes
from tierzero.storage.nvme.chunkfile import probe_direct

if TYPE_CHECKING:  # imported where a stage trains: they load the engine
    from tierzero.config import Config
    from tierzero.engine import Engine

Say = Callable[[str], None]
QUICK_PRESETS = ("tiny", "125m", "350m", "1b")  # --quick sizes within these (1b: vocab 128k, tied)
DISK_HEADROOM = 0.9  # of the work dir's free bytes


@dataclass(frozen=True)
class Options:
    """What `benchmarks/gpu.py` was asked (see its flags)."""

    work_dir: Path
    repo: Path
    minutes: float = 6.0
    quick: bool = False
    device: str = "cuda"
    preset: str | None = None
    placements: tuple[str, ...] = ("host", "nvme")
    seq_len: int = 2048
    max_steps: int = 3
    max_accumulate: int = 8
    largest_micro_batch: int = 16
    host_fraction: float = 0.8
    gpu_bytes: int | None = None  # a cap on the GPU memory torch may use
    optimizer_device: str = "auto"  # where the step runs (`--optimizer-device`)

    @property
    def budget_s(self) -> float:
        return self.minutes * 60

    @property
    def presets(self) -> list[str]:
        if self.preset is not None:
            return [self.preset]
        if self.device == "cpu":
            return ["tiny"]
        return list(QUICK_PRESETS) if self.quick else list(PRESETS)

    @property
    def probe_s(self) -> float:
        """The time planned for measuring the peaks (and, on a GPU, the 1 GiB disk probe)."""
        return 3.0 if self.device == "cpu" else 20.0 if self.quick else 45.0

    @property
    def tests_s(self) -> float:
        """The time the `pytest -m cuda` child may take (none with --quick)."""
        return 0.0 if self.quick or self.device == "cpu" else min(150.0, 0.25 * self.budget_s)

    def training_s(self, elapsed_s: float) -> float:
        """What is left for training, keeping a tenth of the budget for closing and traces."""
        return max(0.0, 0.9 * self.budget_s - elapsed_s)


def stores_dir(work_dir: Path) -> Path:
    return work_dir / "stores"


def machine_now(options: Options, device: torch.device) -> Machine:
    """What the run may use at this moment; the GPU's figure is 90% of its free memory (capped)."""
    stores = stores_dir(options.work_dir)
    stores.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":  # as the engine's default budget: room for the allocator's own slack
        gpu = int(torch.cuda.mem_get_info(device)[0] * 0.9)
    else:  # the CPU device's "GPU" is host memory too
        gpu = available_host_bytes() // 4
    if options.gpu_bytes is not None:
        gpu = min(gpu, options.gpu_bytes)
    return Machine(
        gpu_bytes=gpu,
        host_bytes=int(available_host_bytes() * options.host_fraction),
        disk_bytes=int(free_disk_bytes([stores]) * DISK_HEADROOM),
        direct_io=probe_direct(str(stores)),
    )


def plan_stages(
    options: Options, machine: Machine, rates: Rates, training_s: float
) -> list[StagePlan | Verdict]:
    """Each placement sized to its share of `training_s` (or the planner's refusal)."""
    shares = plan.share_time(training_s, list(options.placements))
    return [
        plan.size_stage(
            name,
            machine,
            rates,
            shares[name],
            options.presets,
            options.seq_len,
            options.largest_micro_batch,
            options.max_accumulate,
            options.max_steps,
        )
        for name in options.placements
    ]


def dry_run(options: Options) -> list[str]:
    """What a run would do on an H200-class machine with nominal rates: nothing measured or
    trained."""
    machine, rates = plan.NOMINAL_H200, plan.NOMINAL
    elapsed = options.probe_s + options.tests_s
    lines = [
        f"dry run for one H200 (nominal: {machine.gpu_bytes >> 30} GiB GPU, "
        f"{machine.host_bytes / 1e9:.0f} GB host, {machine.disk_bytes / 1e9:.0f} GB disk; "
        f"{rates.bf16_tflops:.0f} TFLOPS bf16, {rates.h2d_gbps:.0f} GB/s H2D, "
        f"{rates.nvme_read_gbps:.0f}/{rates.nvme_write_gbps:.0f} GB/s NVMe)",
        f"time budget: {options.budget_s:.0f} s (--minutes {options.minutes:g}): "
        f"peaks {options.probe_s:.0f} s, pytest -m cuda {options.tests_s:.0f} s, "
        f"training {options.training_s(elapsed):.0f} s, "
        f"closing and traces {0.1 * options.budget_s:.0f} s",
    ]
    for stage in plan_stages(options, machine, rates, options.training_s(elapsed)):
        if isinstance(stage, Verdict):
            lines.append(stage.line())
            continue
        lines.append(
            plan.verdict(
                stage.placement, stage.preset, machine, stage.micro_batch, stage.seq_len
            ).line()
        )
        lines.append(stage.line())
        n = PRESETS[stage.preset].param_count()
        tflops = 6 * n * stage.tokens / stage.step_bound_s / 1e12
        lines.append(
            f"{stage.placement}: model TFLOPS at the bound {tflops:.0f}"
            f" of peak {rates.bf16_tflops:.0f}"
        )
    planned = elapsed + sum(
        s.planned_s
        for s in plan_stages(options, machine, rates, options.training_s(elapsed))
        if isinstance(s, StagePlan)
    )
    lines.append(f"in all: {planned:.0f} s planned of the {options.budget_s:.0f} s budget")
    return lines


class Watchdog:
    """Ends the process at the time budget, after recording that it did: a stage that overruns
    its plan (a hung copy, a slow disk) cannot take the results recorded so far with it."""

    def __init__(self, seconds: float, log: ResultLog, say: Say) -> None:
        self.child: subprocess.Popen | None = None
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._log, self._say, self._seconds = log, say, seconds

    def start(self) -> None:
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()

    def _fire(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
        self._log.append(
            "deadline", message=f"the time budget of {self._seconds:.0f} s ran out; stopped"
        )
        self._say(
            f"the time budget of {self._seconds:.0f} s ran out: stopped (every result so far is in "
            f"{self._log.path})"
        )
        os._exit(124)


def cuda_test_files(repo: Path) -> list[str]:
    """The test files that hold CUDA tests: the child collects only these, not the whole tree."""
    return sorted(
        str(p.relative_to(repo))
        for p in (repo / "tests").rglob("test_*.py")
        if "mark.cuda" in p.read_text()
    )


def run_cuda_tests(repo: Path, out: Path, timeout_s: float, watchdog: Watchdog) -> int:
    """`pytest -m cuda` over the CUDA test files in a child killed at `timeout_s` (124), its
    output in `out`."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda",
        "-p",
        "no:cacheprovider",
        *cuda_test_files(repo),
    ]
    with out.open("w") as log:
        child = watchdog.child = subprocess.Popen(
            cmd, cwd=repo, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            return child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            log.write(f"\ntimed out after {timeout_s:.0f} s\n")
            return 124
        finally:
            watchdog.child = None


def run(options: Options, log: ResultLog, say: Say) -> int:
    """The whole benchmark; 0 when it ran to the end (a placement's refusal or error is a record),
    1 when an error outside any placement ended it (recorded too)."""
    start = time.monotonic()
    watchdog = Watchdog(options.budget_s, log, say)
    watchdog.start()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if options.device == "cuda"
        else torch.device("cpu")
    )
    stores = stores_dir(options.work_dir)
    shutil.rmtree(stores, ignore_errors=True)  # a killed run's stores
    try:
        log.append(
            "start",
            options={k: str(v) for k, v in asdict(options).items()},
            torch=torch.__version__,
            python=sys.version.split()[0],
            gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        )
        machine = machine_now(options, device)
        _say(say, log.append("machine", **asdict(machine)), f"machine now: {machine}")
        rates = measure_rates(device, stores, machine.direct_io, options.quick)
        _say(say, log.append("rates", **asdict(rates)), f"measured peaks: {rates}")
        if options.tests_s > 0:
            rc = run_cuda_tests(
                options.repo, options.work_dir / "pytest-cuda.txt", options.tests_s, watchdog
            )
            _say(
                say,
                log.append(
                    "cuda_tests", exit_code=rc, log=str(options.work_dir / "pytest-cuda.txt")
                ),
                f"pytest -m cuda: exit {rc}",
            )
        stages = plan_stages(options, machine, rates, options.training_s(time.monotonic() - start))
        for stage in stages:  # the planner's verdict on every placement, before any runs
            if isinstance(stage, Verdict):
                _say(say, log.append("refused", **asdict(stage)), stage.line())
            else:
                _say(
                    say,
                    log.append("plan", **asdict(stage), planned_s=stage.planned_s),
                    stage.line(),
                )
        for stage in stages:
            if isinstance(stage, StagePlan):
                _run_stage(stage, options, device, rates, log, say)
        _say(
            say, log.append("end", seconds=time.monotonic() - start), f"done; results in {log.path}"
        )
        return 0
    except (
        Exception
    ) as exc:  # outside a placement (the probe, the machine): recorded, and the run ends
        message = f"{type(exc).__name__}: {exc}"
        _say(say, log.append("error", placement=None, error=message), f"stopped: {message}")
        return 1
    finally:
        watchdog.cancel()
        shutil.rmtree(stores, ignore_errors=True)


def _say(say: Say, record: dict[str, Any], text: str) -> None:
    """Print a record's line once it is on disk, with its number (what a reader can look up)."""
    say(f"[{record['seq']}] {text}")


def _run_stage(
    stage: StagePlan, options: Options, device: torch.device, rates: Rates, log: ResultLog, say: Say
) -> None:
    """One placement: re-checked against the machine as it is now, trained, each step recorded
    as it finishes, then its summary row and one traced step; a refusal or an error is a record."""
    machine = machine_now(options, device)
    check = plan.verdict(stage.placement, stage.preset, machine, stage.micro_batch, stage.seq_len)
    if check.refused:
        _say(say, log.append("refused", **asdict(check)), check.line())
        return
    deadline = time.monotonic() + stage.budget_s
    try:
        _train(stage, machine, device, rates, deadline, options, log, say)
    except Exception as exc:  # recorded, and the next placement runs
        message = f"{type(exc).__name__}: {exc}"
        _say(
            say,
            log.append("error", placement=stage.placement, preset=stage.preset, error=message),
            f"{stage.placement}: failed: {message}",
        )
    finally:
        shutil.rmtree(stores_dir(options.work_dir) / stage.placement, ignore_errors=True)


def _train(
    stage: StagePlan,
    machine: Machine,
    device: torch.device,
    rates: Rates,
    deadline: float,
    options: Options,
    log: ResultLog,
    say: Say,
) -> None:
    """One placement: opened (where its optimizer steps, and why, recorded), a warm-up step,
    timed steps until `deadline` draws near, its summary row, and, if there is time, one
    profiled step whose trace is kept and analysed."""
    from tierzero import models
    from tierzero.engine import Engine
    from tierzero.run.data import TokenBatches, default_corpus

    args = PRESETS[stage.preset]
    data = TokenBatches(default_corpus(64 << 20), stage.micro_batch, stage.seq_len, seed=0)
    opened = time.monotonic()
    model = models.build(args, device="meta", seed=0)
    work_dir = options.work_dir
    config = _config(stage, machine, device, work_dir, options.optimizer_device)
    with Engine(model, config) as engine:
        seconds, why = time.monotonic() - opened, engine.parts.step_reason
        _say(
            say,
            log.append("opened", placement=stage.placement, seconds=seconds, optimizer=why),
            f"{stage.placement}: opened in {seconds:.1f} s; the optimizer steps {why}",
        )
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

        def step() -> float:
            sync()
            begin = time.perf_counter()
            for _ in range(stage.accumulate):
                engine.train_micro_batch(data.next_batch())  # the loss is never read: no sync
            sync()
            return time.perf_counter() - begin

        warm = step()  # pools, caches and the allocator settle
        _say(
            say,
            log.append("step", placement=stage.placement, step=0, warm_up=True, step_s=warm),
            f"{stage.placement}: warm-up step {warm:.2f} s",
        )
        engine.stats()
        registered = engine.parts.tiers.host_pool.registrations
        times, stats = _timed_steps(engine, step, stage, deadline, log, say)
        regs = (engine.parts.tiers.host_pool.registrations - registered) / max(1, len(times))
        row = {
            **plan.report_row(
                stage.placement, args, stage.tokens, statistics.median(times), stats, rates, regs
            ),
            "preset": stage.preset,
            "micro_batch": stage.micro_batch,
            "seq_len": stage.seq_len,
            "accumulate": stage.accumulate,
        }
        _say(
            say,
            log.append("row", **row),
            f"{stage.placement}: median step {row['step_s']:.2f} s, "
            f"{row['model_tflops']:.1f} model TFLOPS, "
            f"{row['step_over_bound']:.2f}x the bound ({row['bound_by']})",
        )
        if time.monotonic() + max(times) > deadline:
            return
        # one step (a vertical step: all its micro-batches) after the timed ones, not among them
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            step()
    _keep_trace(prof, stage, work_dir, log, say)


def _config(
    stage: StagePlan, machine: Machine, device: torch.device, work_dir: Path, optimizer_device: str
) -> Config:
    """The stage's engine config: its placement, bf16, the machine's budgets as they are now,
    the optimizer's side as asked."""
    from tierzero.config import Config

    return Config(
        placement=plan.PLACEMENTS[stage.placement],
        nvme_path=[str(stores_dir(work_dir) / stage.placement)],
        dtype="bf16",
        device=str(device),
        host_budget=machine.host_bytes,
        gpu_budget=machine.gpu_bytes,
        prefetch_depth=plan.PREFETCH_DEPTH,
        accumulate=stage.accumulate,
        schedule=plan.schedule_for(stage.accumulate),
        total_steps=stage.steps + 2,
        warmup_steps=1,
        optimizer_device=optimizer_device,
    )


def _timed_steps(
    engine: Engine,
    step: Callable[[], float],
    stage: StagePlan,
    deadline: float,
    log: ResultLog,
    say: Say,
) -> tuple[list[float], dict[str, Any]]:
    """Up to the stage's steps, each recorded as it finishes, stopping when one more (as long as
    the longest so far) would end past `deadline`; their seconds and the last step's stats."""
    times: list[float] = []
    stats: dict[str, Any] = {}
    for i in range(stage.steps):
        if times and time.monotonic() + max(times) > deadline:
            _say(
                say,
                log.append(
                    "stopped",
                    placement=stage.placement,
                    reason="its share of the time budget",
                    steps=len(times),
                ),
                f"{stage.placement}: stopped after {len(times)} steps",
            )
            break
        times.append(step())
        stats = engine.stats()
        _say(
            say,
            log.append(
                "step", placement=stage.placement, step=i + 1, step_s=times[-1], stats=stats
            ),
            f"{stage.placement}: step {i + 1} {times[-1]:.2f} s",
        )
    return times, stats


def _keep_trace(
    prof: torch.profiler.profile, stage: StagePlan, work_dir: Path, log: ResultLog, say: Say
) -> None:
    """The profiled step's trace, compressed into the work dir, and what its analysis found."""
    raw = stores_dir(work_dir) / f"trace-{stage.placement}.json"
    prof.export_chrome_trace(str(raw))
    trace = load_trace(raw)
    raw.unlink()
    written = write_trace(trace, work_dir / f"trace-{stage.preset}-{stage.placement}.json.gz")
    summary = analyse(trace)
    busy = summary["gpu_busy_share"]
    _say(
        say,
        log.append("trace", placement=stage.placement, **written, **summary),
        f"{stage.placement}: trace {written['path']} ({written['nbytes'] / 1e6:.1f} MB), GPU busy "
        + (f"{busy:.0%}" if busy is not None else "n/a (no GPU activity)"),
    )
