"""The note a resumed run prints names what changed: a longer --steps only stretches the lr
schedule (no "other optimizer settings"); a changed --lr is named as such."""

from __future__ import annotations

import json

from tierzero.cli.app import app
from typer.testing import CliRunner

runner = CliRunner()
QUICK = ["--batch-size", "2", "--seq-len", "16", "--dtype", "fp32", "--offload", "nvme"]


def test_resume_note_names_what_changed(tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    first = runner.invoke(app, ["train", *QUICK, "--steps", "2", "--run-dir", run_dir])
    assert first.exit_code == 0, first.output
    longer = runner.invoke(app, ["train", "--resume", "--run-dir", run_dir, "--steps", "3"])
    assert longer.exit_code == 0, longer.output
    text = " ".join(longer.output.split())
    assert (
        "the lr schedule now spans 3 steps, not the 2 of the run" in text and "other" not in text
    ), text
    other_lr = runner.invoke(
        app, ["train", "--resume", "--run-dir", run_dir, "--steps", "4", "--lr", "0.002"]
    )
    assert other_lr.exit_code == 0, other_lr.output
    assert "was written with other settings (lr, total_steps)" in " ".join(
        other_lr.output.split()
    ), other_lr.output


def test_a_resume_from_an_older_checkpoint_with_fewer_steps(tmp_path) -> None:
    """The note states the schedule followed (a shorter one), and metrics.jsonl holds each step's
    row once: the replayed steps' rows are replaced, not repeated."""
    run_dir = tmp_path / "run"
    first = runner.invoke(
        app, ["train", *QUICK, "--steps", "4", "--checkpoint-every", "2", "--run-dir", str(run_dir)]
    )
    assert first.exit_code == 0, first.output
    (run_dir / "checkpoints" / "step-00000004" / "manifest.json").write_text("{damaged")
    shorter = runner.invoke(app, ["train", "--resume", "--run-dir", str(run_dir), "--steps", "3"])
    assert shorter.exit_code == 0, shorter.output
    text = " ".join(shorter.output.split())
    assert "resumed from checkpoint step 2" in text
    assert "the lr schedule now spans 3 steps, not the 4 of the run" in text
    assert "follows the shorter schedule" in text and "longer schedule" not in text, text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
