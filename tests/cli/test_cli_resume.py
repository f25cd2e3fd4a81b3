"""`tierzero train --resume` through typer's runner: continuing, and every refusal in one line."""

from __future__ import annotations

import json
import shutil

from tests.support.cli import one_line_error, train
from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.run.directory import read_metrics


def test_resume_continues_to_the_configured_steps(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert (
        train("--steps", "3", "--checkpoint-every", "2", "--run-dir", str(run_dir)).exit_code == 0
    )
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [2, 3]
    result = train("--resume", "--run-dir", str(run_dir), "--steps", "5", "--json")
    assert result.exit_code == 0, result.output
    assert "resumed from checkpoint step 3" in result.output
    assert json.loads(result.stdout[result.stdout.index("{") :])["start_step"] == 3
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2, 3, 4, 5]
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [4, 5]  # --keep-checkpoints 2 (default)


def test_resume_of_a_missing_directory_is_one_line(tmp_path) -> None:
    line = one_line_error(train("--resume", "--run-dir", str(tmp_path / "nope")))
    assert "does not exist" in line and "drop --resume" in line
    assert "needs --run-dir" in one_line_error(train("--resume"))


def test_resume_without_a_checkpoint_starts_at_step_zero_and_says_so(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = train("--resume", "--run-dir", str(run_dir), "--steps", "1")
    assert result.exit_code == 0, result.output
    assert "no checkpoint yet: starting from step 0" in result.output


def test_resume_with_every_checkpoint_damaged_is_refused(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert train("--steps", "1", "--run-dir", str(run_dir)).exit_code == 0
    (checkpoint_dirs(run_dir)[-1][1] / "manifest.json").write_text("{not json")
    line = one_line_error(train("--resume", "--run-dir", str(run_dir), "--steps", "2"))
    assert "no intact checkpoint is left" in line and "step-00000001" in line


def test_resume_with_another_model_shape_is_refused(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert train("--steps", "1", "--run-dir", str(run_dir)).exit_code == 0
    shutil.rmtree(run_dir / "nvme")
    line = one_line_error(
        train(
            "--resume",
            "--run-dir",
            str(run_dir),
            "--model",
            "125m",
            "--steps",
            "2",
            "--host-budget",
            "4GiB",
        )
    )
    assert "another model shape" in line


def test_checkpoints_with_the_in_memory_trainer_are_refused(tmp_path) -> None:
    line = one_line_error(
        train("--offload", "none", "--checkpoint-every", "1", "--run-dir", str(tmp_path / "r"))
    )
    assert "tiered run" in line


def test_resume_pointed_inside_a_run_directory_names_the_run_directory(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert train("--steps", "1", "--run-dir", str(run_dir)).exit_code == 0
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    for inside in (checkpoint_dirs(run_dir)[-1][1], run_dir / "nvme"):
        line = one_line_error(train("--resume", "--run-dir", str(inside), "--steps", "2"))
        assert (
            f"lies inside the run directory '{run_dir}'" in line and f"--run-dir {run_dir}" in line
        )
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before  # nothing written


def test_resume_and_overwrite_together_are_refused(tmp_path) -> None:
    assert "pass one of them" in one_line_error(
        train("--resume", "--overwrite", "--run-dir", str(tmp_path))
    )


def test_a_copied_run_directory_resumes_against_its_own_store(tmp_path) -> None:
    original, copy = tmp_path / "original", tmp_path / "copy"
    assert train("--steps", "1", "--run-dir", str(original)).exit_code == 0
    # relative to the run dir
    assert 'nvme_path = ["nvme"]' in (original / "config.toml").read_text()
    shutil.copytree(original, copy)
    shutil.rmtree(original)
    result = train("--resume", "--run-dir", str(copy), "--steps", "2")
    assert result.exit_code == 0, result.output
    assert not original.exists()  # nothing went to the original's store


def test_an_absolute_run_dir_resumes_from_any_working_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert (
        train(
            "--steps", "1", "--run-dir", str(tmp_path / "run"), "--nvme-path", "run/store"
        ).exit_code
        == 0
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = train("--resume", "--run-dir", str(tmp_path / "run"), "--steps", "2")
    assert result.exit_code == 0, result.output
    assert "resumed from checkpoint step 1" in result.output
    assert list(elsewhere.iterdir()) == []


def test_identical_runs_save_identical_rng_states(tmp_path) -> None:
    import torch

    from tierzero.checkpoint.catalog import newest_checkpoint

    states = []
    for name in ("a", "b"):
        torch.rand(7)  # whatever ran before in this process must not matter
        assert (
            train("--steps", "1", "--seed", "3", "--run-dir", str(tmp_path / name)).exit_code == 0
        )
        states.append(newest_checkpoint(tmp_path / name)[1].rng)
    assert states[0] == states[1]


def test_a_resume_after_skipped_fp16_steps_trains_the_batches_an_uninterrupted_run_does(
    tmp_path,
) -> None:
    """A loss scale that doubles after every good step overflows fp16 again and again: steps are
    skipped, each taking a batch. A resume from a checkpoint after a skip goes on from the batches
    taken (its step plus the skips), so it ends bitwise where the uninterrupted run does, not
    with extra batches trained."""
    import torch
    from tierzero.storage.nvme.arrays import read_array

    from tierzero.checkpoint.catalog import newest_checkpoint

    config = tmp_path / "fp16.toml"
    config.write_text('dtype = "fp16"\nloss_scale = 65536.0\nloss_scale_window = 1\n')
    args = [
        "--config",
        str(config),
        "--steps",
        "5",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "9",
    ]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert train(*args, "--run-dir", str(straight)).exit_code == 0
    shutil.copytree(straight, crashed)
    for step, path in checkpoint_dirs(
        crashed
    ):  # as if killed right after the first checkpoint past a skip
        if step > 2:
            shutil.rmtree(path)
    assert newest_checkpoint(crashed)[1].engine["skipped_steps"] > 0
    result = train(*args, "--resume", "--run-dir", str(crashed))
    assert result.exit_code == 0, result.output
    (a_path, a, _), (b_path, b, _) = newest_checkpoint(crashed), newest_checkpoint(straight)
    assert (a.step, a.data, a.engine) == (b.step, b.data, b.engine)
    for key in b.arrays:
        assert torch.equal(
            read_array(str(a.array_dir(a_path, key)), a.arrays[key]),
            read_array(str(b.array_dir(b_path, key)), b.arrays[key]),
        ), key
