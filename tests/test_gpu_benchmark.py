"""The GPU benchmark's logic that needs no GPU (`tierzero.bench`): the planner's verdict, the
traffic model and the bound, the sizing of each placement to its share of the time budget, the
results log, the trace analysis, and the run's records of refusals and errors. Two tests start
`benchmarks/gpu.py` itself: its dry run, and a CPU run killed mid-step by SIGKILL."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tierzero.bench import gpu_run, plan
from tierzero.bench.plan import Machine, Rates, StagePlan, Verdict
from tierzero.bench.results import ResultLog, read_results
from tierzero.bench.trace import analyse, load_trace, write_trace
from tierzero.config import Schedule
from tierzero.models.presets import PRESETS

GB = 10**9
REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu.py"


def test_it_picks_the_largest_preset_that_fits_both_placements() -> None:
    machine = Machine(gpu_bytes=24 << 30, host_bytes=64 * GB, disk_bytes=2000 * GB)
    name = plan.pick_preset(machine, seq_len=4096)
    assert name is not None
    chosen = PRESETS[name]
    for placement in plan.PLACEMENTS.values():
        assert plan.fits(plan.memory(chosen, placement, 1, min(4096, chosen.max_seq_len)), machine)
    for other, args in PRESETS.items():  # nothing larger fits in both
        if args.param_count() > chosen.param_count():
            assert not all(
                plan.fits(plan.memory(args, p, 1, min(4096, args.max_seq_len)), machine)
                for p in plan.PLACEMENTS.values()
            ), other
    assert plan.pick_preset(Machine(1 << 20, 1 << 20, 1 << 20), seq_len=4096) is None


def test_the_bound_is_the_slowest_resource_and_nothing_to_move_takes_no_time() -> None:
    rates = Rates(
        bf16_tflops=100.0,
        h2d_gbps=10.0,
        d2h_gbps=20.0,
        nvme_read_gbps=4.0,
        nvme_write_gbps=2.0,
        adam_params_per_s=1e9,
    )
    traffic = {"h2d": 10 * GB, "d2h": 10 * GB, "nvme_read": 4 * GB, "nvme_write": 2 * GB}
    b = plan.bound(n_params=10**9, tokens=10**4, traffic=traffic, rates=rates)
    assert b["compute"] == pytest.approx(8e13 / 1e14)  # 8 N tokens over the peak: 0.8 s
    assert (b["h2d"], b["d2h"], b["nvme"], b["cpu_adam"]) == pytest.approx((1.0, 0.5, 2.0, 1.0))
    assert b["bound_by"] == "nvme" and b["bound_s"] == pytest.approx(2.0)
    unmeasured = Rates(
        100.0, 10.0, 20.0, 0.0, 0.0, 1e9
    )  # a disk without direct I/O is not measured
    host = plan.bound(10**9, 10**4, {**traffic, "nvme_read": 0, "nvme_write": 0}, unmeasured)
    assert host["nvme"] == 0.0 and host["bound_by"] == "h2d"
    assert plan.bound(10**9, 10**4, traffic, unmeasured)["bound_s"] == float("inf")


def test_every_micro_batch_moves_the_params_twice_and_the_grads_again() -> None:
    args = PRESETS["1b"]
    n, p = args.param_count(), 2 * args.param_count() * plan.COMPUTE_ITEMSIZE  # forward + recompute
    one, three = plan.step_traffic(args, "host", 1), plan.step_traffic(args, "host", 3)
    assert (one["h2d"], one["d2h"]) == (p, 4 * n)
    assert (three["h2d"], three["d2h"]) == (
        3 * p + 2 * 4 * n,
        3 * 4 * n,
    )  # two earlier sums come back
    assert three["nvme_read"] == three["nvme_write"] == 0
    nvme_one, nvme_three = plan.step_traffic(args, "nvme", 1), plan.step_traffic(args, "nvme", 3)
    assert nvme_three["nvme_read"] - nvme_one["nvme_read"] == 2 * p + 2 * 4 * n
    assert nvme_three["nvme_write"] - nvme_one["nvme_write"] == 2 * 4 * n


def test_layer_major_accumulation_moves_the_params_once_per_pass_and_the_waiting_inputs() -> None:
    args, micro_tokens = PRESETS["1b"], 4096
    n, p = args.param_count(), 2 * args.param_count() * plan.COMPUTE_ITEMSIZE
    waiting = (
        3 * args.n_layers * micro_tokens * args.dim * plan.COMPUTE_ITEMSIZE
    )  # out after forward, back for backward
    three = plan.step_traffic(args, "nvme", 3, Schedule.VERTICAL, micro_tokens)
    assert (three["h2d"], three["d2h"]) == (p + waiting, 4 * n + waiting)
    assert (three["nvme_read"], three["nvme_write"]) == (
        p + 12 * n,
        n * plan.COMPUTE_ITEMSIZE + 12 * n,
    )
    assert plan.schedule_for(1) == Schedule.HORIZONTAL and plan.schedule_for(3) == Schedule.VERTICAL


def test_accumulation_amortises_only_what_a_step_moves_once() -> None:
    args, tokens = PRESETS["1b"], 4096
    n = args.param_count()
    slow = Rates(
        bf16_tflops=1000.0,
        h2d_gbps=10.0,
        d2h_gbps=20.0,
        nvme_read_gbps=4.0,
        nvme_write_gbps=2.0,
        adam_params_per_s=1e9,
    )
    assert plan.pick_accumulation(args, "host", tokens, slow, most=64) < 64
    assert (
        plan.bound(n, tokens * 64, plan.step_traffic(args, "host", 64), slow)["bound_by"] == "h2d"
    )
    fast = Rates(
        bf16_tflops=100.0,
        h2d_gbps=1000.0,
        d2h_gbps=1000.0,
        nvme_read_gbps=4.0,
        nvme_write_gbps=2.0,
        adam_params_per_s=1e9,
    )
    a = plan.pick_accumulation(args, "host", tokens, fast, most=1000)
    near, short = (
        plan.bound(n, tokens * k, plan.step_traffic(args, "host", k), fast) for k in (a, a - 1)
    )
    assert near["bound_s"] <= 1.1 * near["compute"] and short["bound_s"] > 1.1 * short["compute"]


def test_the_verdict_names_the_tier_that_does_not_fit_and_a_disk_without_direct_io() -> None:
    roomy = Machine(gpu_bytes=80 << 30, host_bytes=64 * GB, disk_bytes=2000 * GB)
    assert plan.verdict("host", "1b", roomy).refused is None
    tight = plan.verdict("host", "1b", Machine(80 << 30, 2 * GB, 2000 * GB))
    assert (
        tight.refused.startswith("refused: host needs")
        and tight.needs["host"] > tight.budgets["host"]
    )
    assert "refused: host" in tight.line()
    no_direct = plan.verdict("nvme", "1b", Machine(80 << 30, 64 * GB, 2000 * GB, direct_io=False))
    assert "O_DIRECT" in no_direct.refused
    assert (
        plan.verdict("host", "1b", Machine(80 << 30, 64 * GB, 2000 * GB, direct_io=False)).refused
        is None
    )


def test_each_placement_is_sized_to_its_share_of_the_time_budget() -> None:
    h200, rates = plan.NOMINAL_H200, plan.NOMINAL
    quick = ["tiny", "125m", "350m", "1b"]
    stage = plan.size_stage("nvme", h200, rates, 180.0, quick, 2048, 16, 8, max_steps=50)
    assert isinstance(stage, StagePlan) and stage.planned_s <= 180.0
    assert (
        stage.planned_s + stage.planned_step_s > 180.0 or stage.steps == 50
    )  # as many steps as fit
    larger = [p for p in quick if PRESETS[p].param_count() > PRESETS[stage.preset].param_count()]
    for preset in larger:  # nothing larger fits with a timed step
        bigger = plan.size_stage("nvme", h200, rates, 180.0, [preset], 2048, 16, 8, max_steps=1)
        assert isinstance(bigger, Verdict) and "planned" in bigger.refused
    capped = plan.size_stage("host", h200, rates, 10_000.0, quick, 2048, 16, 8, max_steps=3)
    assert capped.steps == 3 and capped.preset == "1b"
    refused = plan.size_stage("nvme", h200, rates, 0.1, quick, 2048, 16, 8, max_steps=3)
    assert (
        isinstance(refused, Verdict)
        and refused.preset == "tiny"
        and "raise --minutes" in refused.refused
    )
    assert plan.share_time(100.0, ["host", "nvme"]) == pytest.approx({"host": 40.0, "nvme": 60.0})


def test_the_dry_run_prints_the_plan_the_bound_and_the_budget_it_fits() -> None:
    """`python benchmarks/gpu.py --quick --dry-run`, as a user starts it, on a CPU-only machine."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--dry-run"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[0].startswith("dry run for one H200") and out[1].startswith("time budget: 360 s")
    assert "pytest -m cuda 0 s" in out[1]  # --quick runs no pytest child
    for name in plan.PLACEMENTS:
        assert any(line.startswith(f"{name} (1b): fits") for line in out)
        assert any(line.startswith(f"{name}: 1b,") and "bound" in line for line in out)
    planned = re.fullmatch(r"in all: (\d+) s planned of the 360 s budget", out[-1])
    assert planned and int(planned.group(1)) <= 360
    # the host placement's plan can reach half the peak: its bound is compute, not a link
    host = next(line for line in out if line.startswith("host: model TFLOPS at the bound"))
    assert int(host.split()[6]) >= 0.5 * plan.NOMINAL.bf16_tflops


def test_results_are_on_disk_as_they_are_appended_and_a_torn_line_is_skipped(tmp_path) -> None:
    path = tmp_path / "results.jsonl"
    with ResultLog(path, run="a") as log:
        log.append("rates", h2d_gbps=50.0)
        assert [r["kind"] for r in read_results(path)] == ["rates"]  # before close
        log.append("error", error="ConfigError: no room")
    with ResultLog(path, run="b") as log:
        log.append("start")
    with path.open("a") as f:
        f.write('{"run": "b", "seq": 1, "ki')  # a power loss mid-line
    assert [(r["run"], r["seq"], r["kind"]) for r in read_results(path)] == [
        ("a", 0, "rates"),
        ("a", 1, "error"),
        ("b", 0, "start"),
    ]
    assert [r["kind"] for r in read_results(path, run="a")] == ["rates", "error"]


def _x(
    name: str, cat: str, ts: float, dur: float, tid: object, correlation: int | None = None
) -> dict:
    event = {
        "ph": "X",
        "name": name,
        "cat": cat,
        "ts": ts,
        "dur": dur,
        "pid": 0 if cat in ("kernel", "gpu_memcpy") else 1,
        "tid": tid,
    }
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


SYNTHETIC = {
    "traceEvents": [
        _x("aten::mm", "cpu_op", 0, 10, 1),
        _x("cudaLaunchKernel", "cuda_runtime", 2, 2, 1, 1),
        _x("gemm_1", "kernel", 5, 25, "stream 7", 1),
        _x("aten::copy_", "cpu_op", 10, 4, 1),
        _x("cudaMemcpyAsync", "cuda_runtime", 11, 1, 1, 2),
        _x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 12, 28, "stream 8", 2),
        _x("aten::item", "cpu_op", 14, 56, 1),
        _x("cudaStreamSynchronize", "cuda_runtime", 15, 54, 1),
        _x("aten::mm", "cpu_op", 70, 5, 1),
        _x("cudaLaunchKernel", "cuda_runtime", 71, 1, 1, 3),
        _x("gemm_2", "kernel", 72, 8, "stream 7", 3),
        _x("aten::add", "cpu_op", 75, 3, 1),
        _x("cudaLaunchKernel", "cuda_runtime", 76, 1, 1, 4),
        _x("add_kernel", "kernel", 90, 10, "stream 9", 4),  # waited for an event on stream 9
        _x("adamw", "cpu_op", 100, 10, 2),  # another thread, after the GPU's last work
        {"ph": "s", "name": "flow", "ts": 2, "pid": 1, "tid": 1, "id": 1},
    ]
}


def test_the_trace_analysis_finds_busy_share_copy_overlap_and_the_largest_idle_gaps() -> None:
    summary = analyse(SYNTHETIC)
    assert summary["window_us"] == 110 and summary["gpu_events"] == 4
    assert summary["gpu_busy_share"] == pytest.approx(
        (35 + 8 + 10) / 110
    )  # [5, 40], [72, 80], [90, 100]
    assert summary["compute_busy_share"] == pytest.approx((25 + 8 + 10) / 110)
    assert summary["copy_overlap"] == pytest.approx(
        18 / 28
    )  # the copy runs beside gemm_1 in [12, 30]
    assert [(g["start_us"], g["dur_us"], g["next_gpu"]) for g in summary["gaps"]] == [
        (40, 32, "gemm_2"),
        (80, 10, "add_kernel"),
        (100, 10, ""),
        (0, 5, "gemm_1"),
    ]
    sync, event, tail, head = summary["gaps"]
    assert (
        sync["cause"] == "aten::item" and sync["launched_by"] == "aten::mm"
    )  # the host held the GPU idle
    assert (
        event["cause"].startswith("an event on another stream")
        and event["launched_by"] == "aten::add"
    )
    assert tail["cause"] == "adamw"
    assert head["cause"] == "aten::mm"  # nothing else ran before the first launch
    assert len(analyse(SYNTHETIC, largest=2)["gaps"]) == 2


def test_a_cpu_profiled_trace_has_no_gpu_figures_and_the_written_trace_keeps_under_its_limit(
    tmp_path,
) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        a = torch.randn(64, 64)
        for _ in range(20):
            a = torch.relu(a @ a)
    prof.export_chrome_trace(str(tmp_path / "cpu.json"))
    trace = load_trace(tmp_path / "cpu.json")
    summary = analyse(trace)
    assert summary["gpu_events"] == 0 and summary["window_us"] > 0
    assert (
        summary["gpu_busy_share"] is None
        and summary["copy_overlap"] is None
        and summary["gaps"] == []
    )
    written = write_trace(trace, tmp_path / "cpu.json.gz")
    assert written["dropped_host_below_us"] == 0 and load_trace(tmp_path / "cpu.json.gz") == trace
    padded = {
        "traceEvents": SYNTHETIC["traceEvents"]
        + [_x(f"tiny_op_{i}", "cpu_op", 200 + i, 1, 3) for i in range(5000)]
    }
    full = write_trace(padded, tmp_path / "full.json.gz")
    small = write_trace(padded, tmp_path / "small.json.gz", limit_bytes=full["nbytes"] // 4)
    assert small["nbytes"] < full["nbytes"] // 4 and small["dropped_host_below_us"] > 0
    kept = {e["name"] for e in load_trace(tmp_path / "small.json.gz")["traceEvents"]}
    assert {"gemm_1", "gemm_2", "add_kernel", "cudaStreamSynchronize", "aten::item"} <= kept
    trimmed = analyse(
        load_trace(tmp_path / "small.json.gz")
    )  # the GPU timeline is whole (the run analyses the full trace)
    assert [(g["start_us"], g["dur_us"]) for g in trimmed["gaps"]] == [
        (40, 32),
        (80, 10),
        (100, 10),
        (0, 5),
    ]
    assert trimmed["gpu_busy_share"] * trimmed["window_us"] == pytest.approx(35 + 8 + 10)


def _options(tmp_path: Path, **kw) -> gpu_run.Options:
    return gpu_run.Options(work_dir=tmp_path, repo=REPO, device="cpu", minutes=5, **kw)


def test_a_refused_placement_and_a_failing_one_are_records_and_the_run_goes_on(
    tmp_path, monkeypatch
) -> None:
    no_direct = Machine(gpu_bytes=8 * GB, host_bytes=8 * GB, disk_bytes=100 * GB, direct_io=False)
    monkeypatch.setattr(gpu_run, "machine_now", lambda options, device: no_direct)
    monkeypatch.setattr(gpu_run, "measure_rates", lambda *a: Rates(1.0, 1.0, 1.0, 0.0, 0.0, 1e8))
    trained = []

    def train(stage, *a):
        trained.append(stage.placement)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_run, "_train", train)
    said: list[str] = []
    with ResultLog(tmp_path / "results.jsonl", run="r") as log:
        assert gpu_run.run(_options(tmp_path), log, said.append) == 0
    records = read_results(tmp_path / "results.jsonl")
    assert [r["kind"] for r in records] == [
        "start",
        "machine",
        "rates",
        "plan",
        "refused",
        "error",
        "end",
    ]
    refused, error = records[4], records[5]
    assert refused["placement"] == "nvme" and "O_DIRECT" in refused["refused"]
    assert error["placement"] == "host" and error["error"] == (
        "RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    assert (
        trained == ["host"] and len(said) == len(records) - 1
    )  # every record but the start is printed
    assert not (tmp_path / "stores").exists()


def test_the_cuda_tests_child_collects_only_the_cuda_test_files() -> None:
    files = gpu_run.cuda_test_files(REPO)
    assert "tests/engine/test_gpu_pipeline.py" in files and "tests/test_house.py" not in files
    assert all((REPO / f).read_text().count("mark.cuda") for f in files)


def test_a_run_killed_mid_step_keeps_every_finished_result(tmp_path) -> None:
    """SIGKILL a CPU run of the script once it has printed its third timed step: every record it
    printed (it prints a record only once it is on disk) is in results.jsonl, whole, in order."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-u",
            str(SCRIPT),
            "--device",
            "cpu",
            "--placements",
            "host",
            "--steps",
            "1000",
            "--minutes",
            "10",
            "--work-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    guard = threading.Timer(300, child.kill)  # never hang the suite
    guard.start()
    printed = []
    try:
        for line in child.stdout:
            printed.append(line)
            if re.search(r"host: step 3 ", line):
                child.send_signal(signal.SIGKILL)
                break
        printed += child.stdout.read().splitlines()
        child.wait()
    finally:
        guard.cancel()
    assert child.returncode == -signal.SIGKILL, "".join(printed)
    records = read_results(tmp_path / "results.jsonl")
    assert [r["seq"] for r in records] == list(range(len(records)))
    numbered = [int(m.group(1)) for line in printed if (m := re.match(r"\[(\d+)\] ", line))]
    assert numbered and set(numbered) <= {r["seq"] for r in records}
    steps = [r for r in records if r["kind"] == "step" and not r.get("warm_up")]
    assert [r["step"] for r in steps][:3] == [1, 2, 3] and all(r["step_s"] > 0 for r in steps)
    assert {"start", "machine", "rates", "plan", "opened"} <= {r["kind"] for r in records}
    opened = next(r for r in records if r["kind"] == "opened")
    assert opened["optimizer"] == "on the CPU, the compute device"


def test_the_watchdog_records_the_deadline_kills_the_child_and_ends_the_process(
    tmp_path, monkeypatch
) -> None:
    exits: list[int] = []
    monkeypatch.setattr(gpu_run.os, "_exit", exits.append)
    said: list[str] = []
    with ResultLog(tmp_path / "results.jsonl", run="r") as log:
        log.append("start")
        watchdog = gpu_run.Watchdog(0.01, log, said.append)
        watchdog.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        watchdog.start()
        watchdog._timer.join()
    assert exits == [124] and watchdog.child.wait() == -signal.SIGKILL
    assert [r["kind"] for r in read_results(tmp_path / "results.jsonl")] == ["start", "deadline"]
    assert "time budget" in said[0]


def test_an_error_before_any_placement_is_recorded_with_its_message(tmp_path, monkeypatch) -> None:
    def no_disk(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gpu_run, "machine_now", lambda options, device: Machine(GB, GB, GB))
    monkeypatch.setattr(gpu_run, "measure_rates", no_disk)
    said: list[str] = []
    with ResultLog(tmp_path / "results.jsonl", run="r") as log:
        assert gpu_run.run(_options(tmp_path), log, said.append) == 1
    last = read_results(tmp_path / "results.jsonl")[-1]
    assert (
        last["kind"] == "error" and last["error"] == "OSError: [Errno 28] No space left on device"
    )
    assert said[-1].endswith("stopped: OSError: [Errno 28] No space left on device")
