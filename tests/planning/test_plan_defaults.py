"""`tierzero plan` and `tierzero train` on the same machine: the same default budgets, the same
units, the same placement. The machine probe (`tierzero.planning.machine`) is
patched to fixed numbers, so the test describes one machine wherever it runs."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from tierzero import Config, models
from tierzero.config import DType, Placement, RunConfig, Tier
from tierzero.engine import Engine
from tierzero.planning import machine
from tierzero.planning.ledger import GB
from tierzero.planning.placement import candidate_placements, estimate
from tierzero.planning.planreport import make_plan

DISK_FREE = 40 * GB
Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def one_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA, a fixed disk; RAM is set by each test through `available_host_bytes`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: Usage(2 * DISK_FREE, DISK_FREE, DISK_FREE)
    )


def engine(tmp_path: Path) -> Engine:
    config = Config(offload="auto", device="cpu", dtype="fp32", nvme_path=[str(tmp_path / "nvme")])
    return Engine(models.build("tiny", device="meta"), config)


def test_plan_and_train_agree_on_budgets_and_placement(
    one_machine: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Free RAM set so half of it (the default host budget) lies between the largest host
    needs: all-gpu does not fit, so both must offload the same way."""
    monkeypatch.setattr(machine, "available_host_bytes", lambda: 64 * GB)
    probe = engine(tmp_path)
    work = probe.parts.sizing.workload(3)
    needs = sorted({estimate(p, work).resident_bytes[Tier.HOST] for p in candidate_placements()})
    gap = max(
        range(1, len(needs)), key=lambda i: needs[i] - needs[i - 1]
    )  # the widest gap between needs
    host_budget = (needs[gap - 1] + needs[gap]) // 2
    monkeypatch.setattr(machine, "available_host_bytes", lambda: 2 * host_budget)

    trained = engine(tmp_path)
    planned = make_plan("tiny", dtype="fp32", seq_len=8, nvme_path=tmp_path)
    assert planned.device == "cpu" and planned.machine.detected == [
        "host",
        "gpu (host memory, no CUDA)",
        "nvme",
    ]
    assert planned.budgets == {Tier.GPU: None, Tier.HOST: host_budget, Tier.NVME: DISK_FREE}
    assert trained.parts.sizing.budgets() == {Tier.HOST: host_budget, Tier.NVME: DISK_FREE}
    assert [
        (u.name, u.kind, u.padded_numel, u.trainable_numel, u.uses_with) for u in planned.units
    ] == [(u.name, u.kind, u.padded_numel, u.trainable_numel, u.uses_with) for u in trained.units]
    assert planned.choice.fits
    assert planned.placement == trained.parts.layout.placement != Placement()


def test_plan_takes_the_gpu_budget_train_would(
    one_machine: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With CUDA: 90% of GPU 0's free memory, as `machine.default_budgets` gives `train`, and
    bf16 where the GPU computes in it, fp32 where it does not (`machine.default_dtype`)."""
    monkeypatch.setattr(machine, "available_host_bytes", lambda: 64 * GB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    for native, dtype in ((False, DType.FP32), (True, DType.BF16)):

        def bf16_supported(including_emulation: bool = True, native: bool = native) -> bool:
            return native

        monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16_supported)
        assert make_plan("tiny", nvme_path=tmp_path).dtype is dtype
    planned = make_plan("tiny", nvme_path=tmp_path)
    assert planned.device == "cuda" and planned.machine.detected == ["host", "gpu", "nvme"]
    assert planned.budgets == {Tier.GPU: 9 * GB, Tier.HOST: 32 * GB, Tier.NVME: DISK_FREE}
    assert (planned.budgets[Tier.HOST], planned.budgets[Tier.GPU]) == machine.default_budgets(
        torch.device("cuda", 0)
    )


def test_given_sizes_are_not_probed(
    one_machine: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def no_probe() -> int:
        raise AssertionError("probed the machine for a size that was given")

    monkeypatch.setattr(machine, "available_host_bytes", no_probe)
    planned = make_plan("tiny", host_mem="8GB", gpu_mem="4GB", nvme_free="1TB", nvme_path=tmp_path)
    assert planned.machine.detected == []
    assert planned.budgets == {Tier.GPU: 4 * GB, Tier.HOST: 8 * GB, Tier.NVME: 1000 * GB}


def test_plan_defaults_are_what_train_takes(
    one_machine: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without CUDA `train` computes in fp32 (`Config(dtype=None)`), on `RunConfig`'s batch and
    sequence length: `plan` with no --dtype, --batch-size or --seq-len plans that run, not a
    bf16 one at the model's whole context."""
    from tierzero.cli.app import app
    from typer.testing import CliRunner

    from tierzero.precision import resolve_dtype

    monkeypatch.setattr(machine, "available_host_bytes", lambda: 64 * GB)
    config = Config()
    assert resolve_dtype(config.precision.dtype, config.tiering.resolved_device()) is DType.FP32
    planned = make_plan("tiny", nvme_path=tmp_path)
    assert planned.dtype is DType.FP32
    assert (planned.activations.batch_size, planned.activations.seq_len) == (
        RunConfig.batch_size,
        RunConfig.seq_len,
    )
    assert (
        make_plan("tiny", gpus=2, nvme_path=tmp_path).activations.batch_size
        == RunConfig.batch_size // 2
    )
    result = CliRunner().invoke(
        app, ["plan", "--model", "tiny", "--nvme-path", str(tmp_path), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["dtype"] == "fp32"
    assert (
        make_plan("tiny", gpu_mem="80GB", nvme_path=tmp_path).dtype is DType.BF16
    )  # a GPU described, not here


def test_plan_for_gpus_assumes_bf16_and_says_so(
    one_machine: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--gpus N` (1 included) describes GPUs, not this CPU: bf16 unless --dtype says otherwise,
    so the seed's ledger (7B on 8 GPUs: 112 / 38.5 / 26.25 / 14 GB) comes out as asked; the
    dtype and why are one line and two JSON keys."""
    from tierzero.cli.app import app
    from typer.testing import CliRunner

    monkeypatch.setattr(machine, "available_host_bytes", lambda: 64 * GB)

    def plan(*args: str) -> str:
        result = CliRunner().invoke(app, ["plan", "--nvme-path", str(tmp_path), *args])
        assert result.exit_code == 0, result.output
        return result.stdout

    report = json.loads(plan("--model", "7b", "--gpus", "8", "--json"))
    assert [row["gb_per_gpu"] for row in report["ledger"]] == [112, 38.5, 26.25, 14]
    assert (report["dtype"], report["dtype_source"]) == ("bf16", "gpus")
    text = plan("--model", "7b", "--gpus", "8")
    assert "Compute dtype: bf16 (assumed for --gpus: bf16 GPUs; --dtype to change)" in text
    assert make_plan("tiny", gpus=1, nvme_path=tmp_path).dtype is DType.BF16
    fp32 = json.loads(plan("--model", "7b", "--gpus", "8", "--dtype", "fp32", "--json"))
    assert [row["bytes_per_param"] for row in fp32["ledger"]] == [
        20,
        4 + 4 + 12 / 8,
        4 + 16 / 8,
        20 / 8,
    ]
    assert (fp32["dtype"], fp32["dtype_source"]) == ("fp32", "dtype")
    assert "Compute dtype: fp32 (--dtype)" in plan(
        "--model", "tiny", "--gpus", "2", "--dtype", "fp32"
    )
    alone = json.loads(plan("--model", "tiny", "--json"))  # no --gpus: what train computes in here
    assert (alone["dtype"], alone["dtype_source"]) == ("fp32", "train")
