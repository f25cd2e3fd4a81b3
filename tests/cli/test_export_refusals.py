"""`tierzero export` of a run that has no checkpoint says why, in one line and no other."""

from __future__ import annotations

import numpy as np
from tierzero.cli.app import app
from typer.testing import CliRunner

runner = CliRunner()


def test_a_run_whose_train_was_refused_never_trained(tmp_path):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(300, dtype=np.uint16))  # beyond tiny's vocabulary: refused before step 1
    run_dir = tmp_path / "run"
    result = runner.invoke(
        app,
        ["train", "--model", "tiny", "--data", str(ids), "--steps", "1", "--run-dir", str(run_dir)],
    )
    assert result.exit_code == 2 and (run_dir / "config.toml").is_file(), result.output
    result = runner.invoke(app, ["export", str(run_dir), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        f"error: run '{run_dir}' never finished a training step (its train was refused or "
        "stopped before step 1), so it has no checkpoint to export; train it first"
    ]


def test_a_run_that_trained_in_memory_has_no_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "train",
            "--model",
            "tiny",
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--seq-len",
            "16",
            "--offload",
            "none",
            "--eval-every",
            "0",
            "--run-dir",
            str(run_dir),
        ],
    )
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["export", str(run_dir), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert (
        len(lines) == 1
        and "has no complete checkpoint yet; train with --checkpoint-every N" in lines[0]
    )
