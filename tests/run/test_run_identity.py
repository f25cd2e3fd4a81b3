"""A run's identity comes first: its config.toml (naming the run id) is durable before run-id,
the lock's pid or any move-aside, so a run stopped at any instant of its start -- a fresh one,
or an --overwrite of a finished one -- resumes as the run it was (or is refused in one line),
never with the defaults or another run's settings."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import tomllib

from tests.support.cli import one_line_error, train
from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.checkpoint.lineage import read_run_id
from tierzero.run.directory import RunDir, config_run_id

OLD = ["--steps", "2", "--checkpoint-every", "2", "--seed", "0"]
NEW = ["--steps", "2", "--seed", "1", "--lr", "0.002", "--overwrite"]


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (no `except Exception` catches it)."""


class KillPoints:
    """Counts the renames (every durable write and every move ends in one) that `RunDir.start`
    makes, and raises `Killed` at the `kill_at`-th."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, kill_at: int | None = None) -> None:
        self.renames: list[str] = []
        self.kill_at = kill_at
        armed = [False]
        real_start, real_rename, real_replace = RunDir.start, os.rename, os.replace

        def start(rundir: RunDir, *args, **kwargs):
            armed[0] = True
            try:
                return real_start(rundir, *args, **kwargs)
            finally:
                armed[0] = False

        def counting(real):
            def call(src, dst, *args, **kwargs):
                if armed[0]:
                    if len(self.renames) == self.kill_at:
                        raise Killed
                    self.renames.append(os.path.basename(dst))
                return real(src, dst, *args, **kwargs)

            return call

        monkeypatch.setattr(RunDir, "start", start)
        monkeypatch.setattr(os, "rename", counting(real_rename))
        monkeypatch.setattr(os, "replace", counting(real_replace))


def summary(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def test_a_run_id_without_a_config_is_refused_on_resume(tmp_path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "run-id").write_text("x\n")
    line = one_line_error(train("--resume", "--run-dir", str(run_dir)))
    assert "started but never configured" in line and "start it again with --overwrite" in line
    # refused before anything is written
    assert sorted(p.name for p in run_dir.iterdir()) == ["run-id"]


def test_the_config_is_written_before_the_run_id(tmp_path, monkeypatch) -> None:
    points = KillPoints(monkeypatch)
    run_dir = tmp_path / "run"
    assert train("--steps", "1", "--run-dir", str(run_dir)).exit_code == 0
    assert points.renames == ["config.toml", "run-id"]
    assert config_run_id(run_dir) == read_run_id(run_dir)


def test_a_fresh_run_stopped_before_its_config_is_refused_on_resume(tmp_path, monkeypatch) -> None:
    KillPoints(monkeypatch, kill_at=0)
    run_dir = tmp_path / "run"
    with pytest.raises(Killed):
        train("--steps", "5", "--seed", "3", "--run-dir", str(run_dir))
    monkeypatch.undo()
    line = one_line_error(train("--resume", "--run-dir", str(run_dir)))
    assert "never configured" in line  # not the defaults, silently


def test_an_overwrite_stopped_anywhere_resumes_as_the_old_run_or_the_new(
    tmp_path, monkeypatch
) -> None:
    # every kill point of the transaction, each followed by a resume: about ten short CLI runs
    finished = tmp_path / "finished"
    assert train(*OLD, "--run-dir", str(finished)).exit_code == 0
    old_id = read_run_id(finished)
    points = KillPoints(monkeypatch)
    scratch = tmp_path / "scratch"
    shutil.copytree(finished, scratch)
    assert train(*NEW, "--run-dir", str(scratch)).exit_code == 0
    # the config (with the new run id) first, then the old run moved aside, then run-id
    assert points.renames == ["config.toml", "step-00000002", "metrics.jsonl", "run-id"]
    monkeypatch.undo()
    outcomes = []
    for kill_at in range(len(points.renames)):
        run_dir = tmp_path / f"killed-{kill_at}"
        shutil.copytree(finished, run_dir)
        with monkeypatch.context() as m:
            KillPoints(m, kill_at=kill_at)
            with pytest.raises(Killed):
                train(*NEW, "--run-dir", str(run_dir))
        resumed = summary(train("--resume", "--run-dir", str(run_dir), "--json"))
        config = tomllib.loads((run_dir / "config.toml").read_text())
        if config["seed"] == 0:  # the old run, whole: resumable from its last checkpoint
            assert resumed["start_step"] == 2 and read_run_id(run_dir) == old_id
            outcomes.append("old")
        else:  # the new run, from its start, with its own settings and run id
            assert (config["seed"], config["lr"], config["steps"]) == (1, 0.002, 2)
            assert resumed["start_step"] == 0 and resumed["steps"] == 2
            assert read_run_id(run_dir) == config_run_id(run_dir) != old_id
            assert (run_dir / "checkpoints" / "abandoned" / "step-00000002").is_dir()
            assert [s for s, _ in checkpoint_dirs(run_dir)] == [2]  # the new run's own
            outcomes.append("new")
    assert outcomes == ["old"] + ["new"] * (len(points.renames) - 1)
