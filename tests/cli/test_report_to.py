"""`tierzero train --report-to` refusals through typer's runner: an unknown tracker, one whose
library is not installed, `none` beside trackers and a bad `report_to` in a --config file are
each one line and exit 2 before the run directory is touched; a tracker that cannot start its
run is one line and exit 2 too, after the run directory was opened."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.cli import one_line_error, train


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in root.rglob("*")
    }


def test_an_unknown_tracker_is_refused_before_the_run_directory_exists(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    line = one_line_error(train("--report-to", "tensorboard,comet", "--run-dir", str(run_dir)))
    assert line == (
        "error: --report-to comet is not a tracker; choose none, or any of tensorboard, wandb, "
        "mlflow, trackio (comma-separated)"
    )
    assert not run_dir.exists()


def test_none_beside_a_tracker_is_refused(tmp_path: Path) -> None:
    line = one_line_error(train("--report-to", "none,mlflow", "--run-dir", str(tmp_path / "run")))
    assert line == (
        "error: --report-to none reports nowhere and cannot be combined with mlflow; pass none "
        "alone, or only trackers"
    )


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "mlflow", "trackio"])
def test_a_tracker_whose_library_is_missing_names_its_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tracker: str
) -> None:
    # what the import system answers for a package not installed
    monkeypatch.setitem(sys.modules, tracker, None)
    run_dir = tmp_path / "run"
    line = one_line_error(train("--report-to", tracker, "--run-dir", str(run_dir)))
    fix = f"pip install 'tierzero[{tracker}]'"
    assert line == f"error: --report-to {tracker} needs the {tracker} package: {fix}"
    assert not run_dir.exists()


def test_a_resume_whose_config_names_a_missing_tracker_leaves_the_run_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.toml").write_text(
        '# run-id: 0123abcd\nsteps = 4\noffload = "nvme"\nreport_to = ["wandb"]\n'
    )
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5, "time": 1.0}\n')
    before = snapshot(run_dir)
    monkeypatch.setitem(sys.modules, "wandb", None)
    line = one_line_error(train("--resume", "--run-dir", str(run_dir)))
    assert line == "error: --report-to wandb needs the wandb package: pip install 'tierzero[wandb]'"
    assert snapshot(run_dir) == before


def test_a_config_files_report_to_must_be_names(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("report_to = 5\n")
    line = one_line_error(train("--config", str(config), "--run-dir", str(tmp_path / "run")))
    assert line == 'error: report_to must name trackers such as "tensorboard,wandb", got 5'
    config.write_text('report_to = ["tensorboard", "neptune"]\n')
    assert "--report-to neptune is not a tracker" in one_line_error(train("--config", str(config)))


def test_a_tracker_that_cannot_start_its_run_stops_the_run_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nowhere://store")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    result = train(
        "--steps",
        "1",
        "--offload",
        "none",
        "--run-dir",
        str(tmp_path / "run"),
        "--report-to",
        "mlflow",
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: --report-to mlflow could not start its run (") and last.endswith(
        "; check MLFLOW_TRACKING_URI (unset, the run keeps a store in its own directory)"
    )
