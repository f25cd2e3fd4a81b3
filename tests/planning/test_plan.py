"""`tierzero plan` and `tierzero.plan`: the tables, the JSON, the Python value and the refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.planning.test_placement import PROFILE, write_profile
from tierzero.config import StateKind, Tier
from tierzero.models.presets import PRESETS
from tierzero.planning import machine as machine_probe
from tierzero.planning.ledger import (
    GB,
)

MACHINE = ["--gpu-mem", "80GB", "--host-mem", "512GB", "--nvme-free", "2TB"]


def run_ok(*args: str) -> str:
    from tierzero.cli.app import app

    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_plan_json_reproduces_the_seed_account() -> None:
    report = json.loads(run_ok("--model", "7b", "--gpus", "8", "--dtype", "bf16", "--json"))
    assert [row["gb_per_gpu"] for row in report["ledger"]] == [112, 38.5, 26.25, 14]
    assert report["model"]["params"] == PRESETS["7b"].param_count()
    assert report["model"]["ledger_params"] == 7 * 10**9


def test_plan_json_verdict_and_placements() -> None:
    report = json.loads(
        run_ok(
            "--model",
            "7b",
            "--gpus",
            "1",
            "--gpu-mem",
            "24GB",
            "--host-mem",
            "32GB",
            "--nvme-free",
            "1TB",
            "--json",
        )
    )
    assert len(report["placements"]) == 13
    assert report["verdict"]["fits"] is True
    assert report["verdict"]["placement"]["master"] == "nvme"
    assert report["machine"]["detected"] == []


@pytest.mark.parametrize(
    "flags,kwargs",
    [
        (
            ["--model", "7b", "--gpu-mem", "24GB", "--host-mem", "32GB", "--nvme-free", "1TB"],
            dict(model="7b", gpu_mem="24GB", host_mem="32GB", nvme_free="1TB"),
        ),
        (
            [
                "--params",
                "68B",
                "--gpus",
                "2",
                "--dtype",
                "fp32",
                "--batch-size",
                "2",
                "--seq-len",
                "1024",
                *MACHINE,
            ],
            dict(
                params="68B",
                gpus=2,
                dtype="fp32",
                batch_size=2,
                seq_len=1024,
                gpu_mem="80GB",
                host_mem="512GB",
                nvme_free="2TB",
            ),
        ),
    ],
)
def test_python_plan_returns_what_the_cli_prints(flags: list[str], kwargs: dict) -> None:
    import tierzero

    printed = json.loads(run_ok(*flags, "--json"))
    report = tierzero.plan(**kwargs)
    assert json.loads(json.dumps(report.as_dict(), default=str)) == printed
    assert {
        k.value: t.value for k, t in zip(StateKind, (report.placement.home(k) for k in StateKind))
    } == printed["verdict"]["placement"]


def test_plan_tables_and_params(tmp_path: Path) -> None:
    text = run_ok("--model", "7b", "--gpus", "8", *MACHINE)
    assert "112" in text and "26.25" in text and "fits:" in text
    profile = str(write_profile(tmp_path, PROFILE))
    assert "shaped like 70b" in run_ok(
        "--params", "68B", "--gpus", "2", "--profile", profile, *MACHINE
    )
    report = json.loads(
        run_ok("--params", "68B", "--gpus", "2", "--profile", profile, *MACHINE, "--json")
    )
    assert report["model"] == {
        "preset": None,
        "shape": "70b",
        "params": 68 * 10**9,
        "ledger_params": 68 * 10**9,
        "units": 82,
        "largest_unit_params": report["model"]["largest_unit_params"],
        "vocab_size": 32000,
    }
    assert all(p["predicted_step_s"] > 0 for p in report["placements"])


def test_plan_detects_the_machine_when_sizes_are_not_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sizes not given are `tierzero train`'s defaults: half the free RAM (not all of it)."""
    monkeypatch.setattr(machine_probe, "available_host_bytes", lambda: 24 * GB)
    report = json.loads(run_ok("--model", "tiny", "--nvme-path", str(tmp_path), "--json"))
    machine = report["machine"]
    assert len(machine["detected"]) == 3
    if not torch.cuda.is_available():  # the gpu tier is host memory, inside the host budget
        assert machine["device"] == "cpu" and machine["gpu_budget_bytes"] is None
        assert machine["host_budget_bytes"] == 12 * GB
    else:
        assert all(machine[f"{t.value}_budget_bytes"] > 0 for t in Tier)


def run_failing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> str:
    """Through the installed entry point, which turns domain errors into exit code 2."""
    from tierzero.cli.app import main

    monkeypatch.setattr(sys, "argv", ["tierzero", "plan", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return " ".join(err.split())  # rich wraps long lines at the console width


def test_missing_nvme_path_is_an_error_when_free_space_is_detected(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = run_failing(
        monkeypatch, capsys, "--model", "tiny", "--nvme-path", str(tmp_path / "absent")
    )
    assert "is not a directory" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "unknown model preset 'nope'"),
        (["--gpus", "0"], "number of GPUs must be an integer >= 1"),
        (["--gpu-mem", "12XB"], "--gpu-mem '12XB' is not a size"),
        (["--params", "lots"], "--params 'lots' is not a positive count"),
        (["--model", "7b", "--params", "7e9"], "give --model or --params, not both"),
        (["--dtype", "fp8"], "--dtype 'fp8' is not valid"),
        (
            ["--profile", "/nonexistent/profile.json"],
            "profile '/nonexistent/profile.json' does not exist",
        ),
        (["--model", "tiny", "--seq-len", "4096"], "exceeds the model's max_seq_len"),
        (["--model", "tiny", "--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
        (
            ["--model", "tiny", "--accumulate", "0"],
            "--accumulate must be an integer >= 1, got 0",
        ),  # was planned
        (
            ["--model", "tiny", "--prefetch-depth", "-1"],
            "--prefetch-depth must be an integer >= 0, got -1",
        ),
        (
            ["--model", "tiny", "--piece-numel", "0"],
            "--piece-numel must be a positive multiple of 2048",
        ),  # crashed
    ],
)
def test_plan_bad_input_is_one_error_and_exit_2(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    err = run_failing(monkeypatch, capsys, *MACHINE, *args)
    assert err.startswith("error:") and message in err
