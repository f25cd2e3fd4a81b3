"""`benchmarks/gpu.py`'s logic that needs no GPU: the preset it picks, the traffic model and
the bound arithmetic, the micro-batch and accumulation it chooses, the dry run's report, and its
refusals without CUDA or --path. (The GPU run itself is never run in CI.)"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tierzero.models.presets import PRESETS

_spec = importlib.util.spec_from_file_location("gpu_bench", Path(__file__).parents[1] / "benchmarks" / "gpu.py")
gpu = importlib.util.module_from_spec(_spec)
sys.modules["gpu_bench"] = gpu  # dataclasses look their module up while the class is built
_spec.loader.exec_module(gpu)

GB = 10**9


def test_it_picks_the_largest_preset_that_fits_both_placements() -> None:
    machine = gpu.Machine(gpu_bytes=24 << 30, host_bytes=64 * GB, disk_bytes=2000 * GB)
    name = gpu.pick_preset(machine, seq_len=4096)
    assert name is not None
    chosen = PRESETS[name]
    for placement in gpu.PLACEMENTS.values():
        assert gpu.fits(gpu.memory(chosen, placement, 1, min(4096, chosen.max_seq_len)), machine)
    for other, args in PRESETS.items():  # nothing larger fits in both
        if args.param_count() > chosen.param_count():
            assert not all(gpu.fits(gpu.memory(args, p, 1, min(4096, args.max_seq_len)), machine)
                           for p in gpu.PLACEMENTS.values()), other
    tiny = gpu.Machine(gpu_bytes=1 << 20, host_bytes=1 << 20, disk_bytes=1 << 20)
    assert gpu.pick_preset(tiny, seq_len=4096) is None


def test_the_bound_is_the_slowest_resource() -> None:
    rates = gpu.Rates(bf16_tflops=100.0, h2d_gbps=10.0, d2h_gbps=20.0, nvme_read_gbps=4.0,
                      nvme_write_gbps=2.0, adam_params_per_s=1e9)
    traffic = {"h2d": 10 * GB, "d2h": 10 * GB, "nvme_read": 4 * GB, "nvme_write": 2 * GB}
    b = gpu.bound(n_params=10**9, tokens=10**4, traffic=traffic, rates=rates)
    assert b["compute"] == pytest.approx(8e13 / 1e14)  # 8 N tokens over the peak: 0.8 s
    assert (b["h2d"], b["d2h"], b["nvme"], b["cpu_adam"]) == pytest.approx((1.0, 0.5, 2.0, 1.0))
    assert b["bound_by"] == "nvme" and b["bound_s"] == pytest.approx(2.0)


def test_every_micro_batch_moves_the_params_twice_and_the_grads_again() -> None:
    args = PRESETS["1b"]
    n, p = args.param_count(), 2 * args.param_count() * gpu.COMPUTE_ITEMSIZE  # forward + recompute
    one, three = gpu.step_traffic(args, "host", 1), gpu.step_traffic(args, "host", 3)
    assert (one["h2d"], one["d2h"]) == (p, 4 * n)
    assert (three["h2d"], three["d2h"]) == (3 * p + 2 * 4 * n, 3 * 4 * n)  # two earlier sums come back
    assert three["nvme_read"] == three["nvme_write"] == 0
    nvme_one, nvme_three = gpu.step_traffic(args, "nvme", 1), gpu.step_traffic(args, "nvme", 3)
    assert nvme_three["nvme_read"] - nvme_one["nvme_read"] == 2 * p + 2 * 4 * n
    assert nvme_three["nvme_write"] - nvme_one["nvme_write"] == 2 * 4 * n


def test_layer_major_accumulation_moves_the_params_once_per_pass_and_the_waiting_inputs() -> None:
    args, micro_tokens = PRESETS["1b"], 4096
    n, p = args.param_count(), 2 * args.param_count() * gpu.COMPUTE_ITEMSIZE
    waiting = 3 * args.n_layers * micro_tokens * args.dim * gpu.COMPUTE_ITEMSIZE  # out after forward, back for backward
    three = gpu.step_traffic(args, "nvme", 3, gpu.Schedule.VERTICAL, micro_tokens)
    assert (three["h2d"], three["d2h"]) == (p + waiting, 4 * n + waiting)
    assert (three["nvme_read"], three["nvme_write"]) == (p + 12 * n, n * gpu.COMPUTE_ITEMSIZE + 12 * n)
    assert gpu.schedule_for(1) == gpu.Schedule.HORIZONTAL and gpu.schedule_for(3) == gpu.Schedule.VERTICAL


def test_accumulation_amortises_only_what_a_step_moves_once() -> None:
    """Where a micro-batch's own transfers outrun its compute, accumulating more gains little
    (only the optimizer's share); where they do not, it stops once the step is within 10% of
    its compute."""
    args, tokens = PRESETS["1b"], 4096
    n = args.param_count()
    slow = gpu.Rates(bf16_tflops=1000.0, h2d_gbps=10.0, d2h_gbps=20.0, nvme_read_gbps=4.0,
                     nvme_write_gbps=2.0, adam_params_per_s=1e9)
    a = gpu.pick_accumulation(args, "host", tokens, slow, most=64)
    assert a < 64
    assert gpu.bound(n, tokens * 64, gpu.step_traffic(args, "host", 64), slow)["bound_by"] == "h2d"
    fast = gpu.Rates(bf16_tflops=100.0, h2d_gbps=1000.0, d2h_gbps=1000.0, nvme_read_gbps=4.0,
                     nvme_write_gbps=2.0, adam_params_per_s=1e9)
    a = gpu.pick_accumulation(args, "host", tokens, fast, most=1000)
    near, short = (gpu.bound(n, tokens * k, gpu.step_traffic(args, "host", k), fast) for k in (a, a - 1))
    assert near["bound_s"] <= 1.1 * near["compute"] and short["bound_s"] > 1.1 * short["compute"]


def test_it_prefers_the_largest_micro_batch_that_fits() -> None:
    args = PRESETS["125m"]
    big = gpu.Machine(gpu_bytes=80 << 30, host_bytes=64 * GB, disk_bytes=2000 * GB)
    micro = gpu.pick_micro_batch(args, big, seq_len=1024)
    assert micro > 8  # not capped where accumulation would stand in for it
    assert all(gpu.fits(gpu.memory(args, p, micro, 1024), big) for p in gpu.PLACEMENTS.values())
    assert micro == 64 or not all(gpu.fits(gpu.memory(args, p, 2 * micro, 1024), big) for p in gpu.PLACEMENTS.values())


def test_dry_run_reports_every_figure_and_no_gpu_refuses(monkeypatch, capsys) -> None:
    assert gpu.main(["--dry-run", "--preset", "125m", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["preset"] == "125m" and not out["measured"]
    assert [r["placement"] for r in out["rows"]] == ["host", "nvme"]
    for row in out["rows"]:
        assert row["step_over_bound"] == pytest.approx(1.0)  # a dry run's step is its bound
        assert row["model_tflops"] == pytest.approx(0.75 * row["hw_tflops"])
    assert len(gpu.table_lines(out["rows"])) == 13
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before any GPU call
    assert gpu.main(["--preset", "125m"]) == 2
    err = capsys.readouterr().err
    assert "needs --path" in err and err.count("\n") == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main([]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "Traceback" not in err and err.count("\n") == 1


def test_quick_dry_run_prints_a_plan_within_six_minutes_and_each_placements_bound(capsys) -> None:
    assert gpu.main(["--quick", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    quick = gpu.Quick()
    assert sum(limit for _, limit in quick.budget_s) <= 6 * 60 and quick.disk_probe_bytes == 1 << 30
    assert any(line.startswith("in all: at most") for line in lines)
    rows = {line.split(":")[0]: line for line in lines if "bound" in line}
    assert set(rows) == set(gpu.PLACEMENTS) and all(quick.preset in row for row in rows.values())
    # the host placement's plan can reach half the peak: its bound is compute, not a link
    h200 = gpu.Machine(139 << 30, int(128 * GB * 0.8), int(64 * GB * 0.9))
    args = PRESETS[quick.preset]
    micro = gpu.pick_micro_batch(args, h200, quick.seq_len, quick.largest_micro_batch)
    acc = gpu.pick_accumulation(args, "host", micro * quick.seq_len, gpu.NOMINAL, dict(quick.max_accumulate)["host"])
    tokens = micro * quick.seq_len * acc
    b = gpu.bound(args.param_count(), tokens, gpu.step_traffic(args, "host", acc), gpu.NOMINAL)
    assert 6 * args.param_count() * tokens / b["bound_s"] / 1e12 >= 0.5 * gpu.NOMINAL.bf16_tflops
    assert f"bound {b['bound_s']:.2f} s" in rows["host"]


def test_quick_runs_the_cuda_tests_trains_both_placements_and_writes_its_directory(tmp_path, monkeypatch) -> None:
    """The GPU calls replaced (no GPU in CI): what --quick runs, in which order, and what it writes."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 141 * GB}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "a fake H200")
    monkeypatch.setattr(gpu, "available_host_bytes", lambda: 128 * GB)
    monkeypatch.setattr(gpu.shutil, "disk_usage", lambda p: type("U", (), {"free": 64 * GB}))

    def rates(device, disk_dir, nbytes, seconds):
        calls.append(f"rates {nbytes}")
        return gpu.NOMINAL

    def train(name, args, machine, device, micro, seq_len, accumulate, steps, workdir, trace):
        calls.append(f"train {name} {trace.name} {steps}")
        trace.write_text("{}")
        return 1.0, {"bytes_host->gpu": GB, "io_wait_s": 0.1}, 0.0

    monkeypatch.setattr(gpu, "measure_rates", rates)
    monkeypatch.setattr(gpu, "run_cuda_tests", lambda out, limit: calls.append(f"tests {limit}") or 0)
    monkeypatch.setattr(gpu, "train", train)
    out = tmp_path / "out"
    assert gpu.main(["--quick", "--path", str(tmp_path / "nvme"), "--out", str(out)]) == 0
    assert calls == [f"rates {1 << 30}", "tests 150", "train host gpu-bench-1b-host.json 2",
                     "train nvme gpu-bench-1b-nvme.json 2"]
    results = json.loads((out / "results.json").read_text())
    assert results["cuda_tests_exit_code"] == 0 and results["gpu"] == "a fake H200"
    assert [r["placement"] for r in results["rows"]] == ["host", "nvme"]
    assert "step / bound" in (out / "table.txt").read_text()
    assert {p.name for p in out.iterdir()} >= {"gpu-bench-1b-host.json", "gpu-bench-1b-nvme.json"}


def test_the_cuda_tests_are_killed_at_their_limit(tmp_path, monkeypatch) -> None:
    def too_slow(cmd, **kw):
        assert cmd[-4:] == ["-m", "cuda", "-p", "no:cacheprovider"] and kw["timeout"] == 5
        raise gpu.subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(gpu.subprocess, "run", too_slow)
    assert gpu.run_cuda_tests(tmp_path / "log.txt", 5) == 124
    assert "timed out after 5 s" in (tmp_path / "log.txt").read_text()
