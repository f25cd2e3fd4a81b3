"""Lineage: a run directory records which run wrote each checkpoint, so pruning never removes
another run's checkpoints or the one just written, a fresh run never silently mixes with an
old one, and checkpoints left off the run's path are moved aside, never deleted."""

from __future__ import annotations

from pathlib import Path

from tests.support.checkpoints import flip_byte, write_checkpoint
from tests.support.cli import one_line_error, train
from tests.support.engine import SMALL, batches
from tierzero import Config, Placement, Tier, models
from tierzero.checkpoint.catalog import checkpoint_dirs, step_dir
from tierzero.checkpoint.lineage import ABANDONED_DIR, read_run_id
from tierzero.checkpoint.manifest import Manifest
from tierzero.engine import Engine

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)


def steps_in(run_dir: Path) -> list[int]:
    return [s for s, _ in checkpoint_dirs(run_dir)]


def test_a_fresh_run_into_a_directory_with_checkpoints_is_refused_and_overwrite_moves_them_aside(
    tmp_path,
) -> None:
    run_dir = tmp_path / "run"
    assert (
        train("--steps", "3", "--checkpoint-every", "1", "--run-dir", str(run_dir)).exit_code == 0
    )
    old_id = read_run_id(run_dir)
    before = {p.name: (p / "manifest.json").read_bytes() for _, p in checkpoint_dirs(run_dir)}
    line = one_line_error(
        train(
            "--steps",
            "2",
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "1",
            "--run-dir",
            str(run_dir),
        )
    )
    assert (
        "already holds checkpoints (steps 2, 3)" in line
        and "--resume" in line
        and "--overwrite" in line
    )
    assert {
        p.name: (p / "manifest.json").read_bytes() for _, p in checkpoint_dirs(run_dir)
    } == before
    assert read_run_id(run_dir) == old_id

    result = train(
        "--steps",
        "2",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "1",
        "--overwrite",
        "--run-dir",
        str(run_dir),
    )
    assert result.exit_code == 0, result.output
    assert "aside into" in result.output and ABANDONED_DIR in result.output
    assert steps_in(run_dir) == [2]  # the new run's own, not the old step 3
    new_id = read_run_id(run_dir)
    assert new_id != old_id and Manifest.load(step_dir(run_dir, 2)).origin.run_id == new_id
    aside = run_dir / "checkpoints" / ABANDONED_DIR
    assert {
        p.name: (p / "manifest.json").read_bytes() for p in aside.iterdir() if p.is_dir()
    } == before
    assert (aside / "metrics.jsonl").is_file()  # the old run's metrics went with its checkpoints


def test_resume_keeps_the_run_id_and_every_manifest_records_it(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert train("--steps", "2", "--run-dir", str(run_dir)).exit_code == 0
    run_id = read_run_id(run_dir)
    assert run_id and Manifest.load(step_dir(run_dir, 2)).origin.run_id == run_id
    assert train("--resume", "--steps", "3", "--run-dir", str(run_dir)).exit_code == 0
    assert (
        read_run_id(run_dir) == run_id
        and Manifest.load(step_dir(run_dir, 3)).origin.run_id == run_id
    )


def test_prune_removes_only_this_lineages_older_checkpoints(tmp_path) -> None:
    run_dir = tmp_path / "run"
    foreign = write_checkpoint(run_dir, models.build(SMALL), step=9)  # another run's, newer
    cfg = Config(
        placement=NVME,
        nvme_path=[str(tmp_path / "nvme")],
        host_budget="256MiB",
        gpu_budget="256MiB",
    )
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        for _ in range(3):
            engine.train_step(data.next_batch())
            engine.save_checkpoint(run_dir, keep=1)
    # the one just written survives; the foreign one is untouched
    assert steps_in(run_dir) == [3, 9]
    assert foreign.is_dir()


def test_resuming_from_an_older_checkpoint_moves_newer_ones_aside(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert (
        train(
            "--steps",
            "3",
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "3",
            "--run-dir",
            str(run_dir),
        ).exit_code
        == 0
    )
    newest = step_dir(run_dir, 3)
    flip_byte(newest, next(iter(Manifest.load(newest).arrays)))
    result = train("--resume", "--steps", "3", "--run-dir", str(run_dir))
    assert result.exit_code == 0, result.output
    assert "skipped checkpoint step-00000003" in result.output
    assert "step-00000003 aside into" in result.output.replace("\n", " ")
    assert (run_dir / "checkpoints" / ABANDONED_DIR / "step-00000003").is_dir()  # kept, not deleted
    assert steps_in(run_dir) == [1, 2, 3]  # step 3 trained again from step 2
    assert Manifest.load(step_dir(run_dir, 3)).origin.run_id == read_run_id(run_dir)
