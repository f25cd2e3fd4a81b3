"""`benchmarks/gpu.py`'s logic that needs no GPU: the preset it picks, the bound arithmetic,
the dry run's report, and its refusal without CUDA. (The GPU run itself is never run in CI.)"""

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
    more = gpu.accumulation_for_compute_bound(PRESETS["1b"], "host", 4096, rates, most=1000)
    n = PRESETS["1b"].param_count()
    assert gpu.bound(n, 4096 * more, gpu.step_traffic(PRESETS["1b"], "host"), rates)["bound_by"] == "compute"
    assert gpu.bound(n, 4096 * (more - 1), gpu.step_traffic(PRESETS["1b"], "host"), rates)["bound_by"] != "compute"


def test_dry_run_reports_every_figure_and_no_gpu_refuses(monkeypatch, capsys) -> None:
    assert gpu.main(["--dry-run", "--preset", "125m", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["preset"] == "125m" and not out["measured"]
    assert [r["placement"] for r in out["rows"]] == ["host", "nvme"]
    for row in out["rows"]:
        assert row["step_over_bound"] == pytest.approx(1.0)  # a dry run's step is its bound
        assert row["model_tflops"] == pytest.approx(0.75 * row["hw_tflops"])
    assert len(gpu.table_lines(out["rows"])) == 13
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main([]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "Traceback" not in err and err.count("\n") == 1
