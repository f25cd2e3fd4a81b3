"""`tierzero plan` on an 80-column terminal: no line longer than 80
characters, no table cell cut short ("80...", "nv..."), sizes in a unit that shows them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tierzero.cli.app import app
from typer.testing import CliRunner

MACHINE = ["--gpu-mem", "24GB", "--host-mem", "64GB", "--nvme-free", "4TB"]
PROFILE = {
    "nvme": {"read_gbps": 3.0, "write_gbps": 2.0},
    "adam": {"params_per_s": 1e9},
    "compute": {"fp32_tflops": 20.0, "bf16_tflops": 100.0},
    "h2d": {"pinned_gbps": 20.0, "pageable_gbps": 8.0},
}


def plan_at_80_columns(*args: str) -> str:
    result = CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture
def profile(tmp_path: Path) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    return str(path)


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "7b", "--gpus", "8", *MACHINE],  # every placement, one rank's share of eight
        ["--model", "llama3-70b", *MACHINE],  # nothing fits: tiers over budget named, the shortfall
        [
            "--model",
            "llama3-70b",
            "--gpus",
            "2",
            "--host-mem",
            "512GB",
            "--gpu-mem",
            "80GB",
            "--nvme-free",
            "20TB",
        ],
        ["--model", "tiny", "--host-mem", "8GB", "--nvme-free", "1TB"],
    ],
    ids=["7b-8-gpus", "70b-does-not-fit", "70b-2-gpus", "tiny"],
)
def test_plan_fits_80_columns(args: list[str]) -> None:
    text = plan_at_80_columns(*args)
    too_long = [line for line in text.splitlines() if len(line) > 80]
    assert not too_long, too_long
    assert "\u2026" not in text and "..." not in text  # rich's ellipsis: a cell cut short


def test_plan_with_a_profile_fits_80_columns_with_its_step_times(profile: str) -> None:
    text = plan_at_80_columns("--params", "68B", "--gpus", "2", "--profile", profile, *MACHINE)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "\u2026" not in text and "step" in text


def test_a_small_model_is_sized_in_megabytes_not_zero_gigabytes() -> None:
    text = plan_at_80_columns(
        "--model", "tiny", "--host-mem", "8GB", "--nvme-free", "1TB", "--dtype", "bf16"
    )
    assert "0.0 GB" not in text and "0.00 GB" not in text
    assert "51.4 MB" in text  # the ledger: 16 B x 3.2M params
    assert "placements, in MB" in text
