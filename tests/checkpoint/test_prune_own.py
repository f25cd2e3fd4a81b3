"""Prunes delete only their own: a run directory inside another run's checkpoints/ or inside an
NVMe store is refused before anything is written, and a pruned checkpoint loses only the files
its manifest lists -- anything else in it is moved into checkpoints/abandoned/, with a note."""

from __future__ import annotations

from tests.support.cli import one_line_error, train
from tierzero.checkpoint.catalog import checkpoint_dirs, step_dir


def test_a_run_dir_inside_another_runs_checkpoint_or_store_is_refused(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert train("--steps", "1", "--run-dir", str(run_dir)).exit_code == 0
    inner = step_dir(run_dir, 1) / "inner"
    line = one_line_error(train("--steps", "1", "--run-dir", str(inner)))
    assert f"inside the checkpoints of the run directory {run_dir}" in line
    assert not inner.exists()
    in_store = run_dir / "nvme" / "mine"
    line = one_line_error(train("--steps", "1", "--run-dir", str(in_store)))
    assert f"inside the NVMe store directory {run_dir / 'nvme'}" in line
    assert not in_store.exists()


def test_a_prune_moves_what_its_manifest_does_not_list_aside(tmp_path) -> None:
    run_dir = tmp_path / "run"
    assert (
        train("--steps", "2", "--checkpoint-every", "1", "--run-dir", str(run_dir)).exit_code == 0
    )
    stray = step_dir(run_dir, 1) / "inner" / "checkpoints" / "step-00000001" / "manifest.json"
    stray.parent.mkdir(parents=True)
    stray.write_text("someone else's")
    result = train("--resume", "--steps", "3", "--run-dir", str(run_dir))
    assert result.exit_code == 0, result.output
    # step 1 pruned (--keep-checkpoints 2)
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [2, 3]
    aside = run_dir / "checkpoints" / "abandoned" / "step-00000001"
    assert (aside / stray.relative_to(step_dir(run_dir, 1))).read_text() == "someone else's"
    assert [p.name for p in aside.iterdir()] == ["inner"]  # the listed files were deleted
    assert "pruning checkpoint step-00000001 found files its manifest does not list" in " ".join(
        result.output.split()
    )
