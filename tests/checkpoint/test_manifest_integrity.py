"""Manifest integrity: a checkpoint's manifest carries a checksum over its own content (the
config.toml snapshot included), and its directory step, manifest step and step count must
agree. One edited digit makes the checkpoint damaged: resume names it and falls back to the
newest intact one, while export of it by step, and `inspect --verify`, refuse it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from tierzero.cli.app import app
from typer.testing import CliRunner

from tierzero.checkpoint.catalog import checkpoint_dirs, step_dir
from tierzero.checkpoint.inspect import inspect_run
from tierzero.checkpoint.manifest import MANIFEST_NAME, Manifest
from tierzero.errors import CheckpointError

runner = CliRunner()
QUICK = ["--batch-size", "2", "--seq-len", "32"]


def train(*args: str):
    return runner.invoke(app, ["train", *QUICK, *args])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("integrity") / "run"
    result = train("--steps", "2", "--checkpoint-every", "1", "--run-dir", str(run_dir))
    assert result.exit_code == 0, result.output
    return run_dir


def edit_digit(path: Path, field: str) -> None:
    """Change the last digit of the first `"field": <number>` in the file, in place."""
    text = path.read_text()
    match = re.search(rf'"{field}": (\d+)', text)
    assert match, field
    end = match.end(1) - 1
    path.write_text(text[:end] + str((int(text[end]) + 1) % 10) + text[end + 1 :])


def test_the_manifest_records_the_config_it_was_written_under(trained: Path) -> None:
    manifest = Manifest.load(step_dir(trained, 2))
    assert manifest.origin.config_toml == (trained / "config.toml").read_text()
    assert manifest.engine["step_count"] == manifest.step == 2


@pytest.mark.parametrize("field", ["position", "step_count", "step", "numel"])
def test_one_edited_digit_is_caught_and_resume_falls_back(
    trained: Path, tmp_path: Path, field: str
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    newest = step_dir(run_dir, 2)
    edit_digit(newest / MANIFEST_NAME, field)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        Manifest.load(newest)
    result = train("--resume", "--steps", "2", "--run-dir", str(run_dir))
    assert result.exit_code == 0, result.output
    assert "skipped checkpoint step-00000002" in result.output and "checksum" in result.output
    assert "resumed from checkpoint step 1" in result.output

    export = runner.invoke(
        app, ["export", str(run_dir), "--step", "1", "--out", str(tmp_path / "w.safetensors")]
    )
    assert export.exit_code == 0, export.output


def test_an_edited_manifest_is_refused_by_export_and_inspect(trained: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    edit_digit(step_dir(run_dir, 2) / MANIFEST_NAME, "step_count")
    export = runner.invoke(
        app, ["export", str(run_dir), "--step", "2", "--out", str(tmp_path / "w.safetensors")]
    )
    assert export.exit_code == 2 and "fails its checksum" in export.output
    assert not (tmp_path / "w.safetensors").exists()
    status = {c.step: (c.status, c.reason) for c in inspect_run(run_dir, verify=True).checkpoints}
    assert status[1][0] == "ok" and status[2][0] == "damaged" and "checksum" in status[2][1]


def test_steps_that_disagree_make_a_checkpoint_damaged(trained: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    # a renamed directory: the manifest's checksum holds, but its step is not the name's
    step_dir(run_dir, 2).rename(step_dir(run_dir, 5))
    with pytest.raises(CheckpointError, match="step-00000005 is damaged"):
        Manifest.load(step_dir(run_dir, 5))
    # a manifest rewritten whole (a valid checksum) whose step count disagrees with its step
    manifest = Manifest.load(step_dir(run_dir, 1))
    manifest.engine["step_count"] = 7
    (step_dir(run_dir, 1) / MANIFEST_NAME).write_bytes(manifest.to_json())
    with pytest.raises(CheckpointError, match="step count 7"):
        Manifest.load(step_dir(run_dir, 1))
    output = train("--resume", "--steps", "3", "--run-dir", str(run_dir)).output
    line = [text for text in output.splitlines() if text.strip()]
    assert len(line) == 1 and "no intact checkpoint is left" in line[0]
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [1, 5]  # nothing lost


def test_a_manifest_without_its_checksum_is_refused(trained: Path) -> None:
    doc = json.loads((step_dir(trained, 1) / MANIFEST_NAME).read_text())
    del doc["checksum"]
    with pytest.raises(CheckpointError, match="fails its checksum"):
        Manifest.from_json(json.dumps(doc).encode(), "manifest.json")
