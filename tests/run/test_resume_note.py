"""The note a resumed run prints names what changed: a longer --steps only stretches the lr
schedule (no "other optimizer settings"); a changed --lr is named as such."""

from __future__ import annotations

from typer.testing import CliRunner

from tierzero.cli.app import app

runner = CliRunner()
QUICK = ["--batch-size", "2", "--seq-len", "16", "--dtype", "fp32", "--offload", "nvme"]


def test_resume_note_names_what_changed(tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    first = runner.invoke(app, ["train", *QUICK, "--steps", "2", "--run-dir", run_dir])
    assert first.exit_code == 0, first.output
    longer = runner.invoke(app, ["train", "--resume", "--run-dir", run_dir, "--steps", "3"])
    assert longer.exit_code == 0, longer.output
    text = " ".join(longer.output.split())
    assert "the lr schedule now spans 3 steps, not the 2 of the run" in text and "other" not in text, text
    other_lr = runner.invoke(app, ["train", "--resume", "--run-dir", run_dir, "--steps", "4", "--lr", "0.002"])
    assert other_lr.exit_code == 0, other_lr.output
    assert "was written with other settings (lr, total_steps)" in " ".join(other_lr.output.split()), other_lr.output
