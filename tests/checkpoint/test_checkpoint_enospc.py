"""ENOSPC in the checkpoint path: creating the checkpoint's directories, linking the store's
chunks into it, writing its manifest. Each is one sentence (exit 2 through the CLI, nothing
printed after it), the failed checkpoint leaves nothing behind, and the previous checkpoint
stays intact and resumable."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from tierzero.cli.app import app
from typer.testing import CliRunner

from tierzero.checkpoint.catalog import checkpoint_dirs, checkpoints_root, newest_checkpoint

QUICK = ["--batch-size", "2", "--seq-len", "32", "--offload", "nvme", "--checkpoint-every", "1"]
SECOND = ".step-00000002.tmp-"  # the temp directory of the step-2 checkpoint


def enospc(*args: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *args[:1])


def inject(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """ENOSPC from the first `where` call that touches the step-2 checkpoint."""
    mkdir, link, fsync = os.mkdir, os.link, os.fsync
    if where == "mkdir":
        monkeypatch.setattr(
            os,
            "mkdir",
            lambda p, *a, **kw: enospc(p) if SECOND in os.fspath(p) else mkdir(p, *a, **kw),
        )
    elif where == "link":
        monkeypatch.setattr(
            os,
            "link",
            lambda s, d, *a, **kw: enospc(d) if SECOND in os.fspath(d) else link(s, d, *a, **kw),
        )
    else:  # the manifest's fsync (its bytes written, no room for them)

        def on_fsync(fd: int) -> None:
            path = os.readlink(f"/proc/self/fd/{fd}")
            if SECOND in path and path.endswith("manifest.json"):
                enospc(path)
            fsync(fd)

        monkeypatch.setattr(os, "fsync", on_fsync)


@pytest.mark.parametrize("where", ["mkdir", "link", "manifest"])
def test_enospc_while_checkpointing_is_one_sentence_and_the_last_checkpoint_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    run_dir = tmp_path / "run"
    runner = CliRunner()
    with monkeypatch.context() as patch:
        inject(patch, where)
        failed = runner.invoke(app, ["train", *QUICK, "--steps", "2", "--run-dir", str(run_dir)])
    assert failed.exit_code == 2, failed.output
    lines = [line for line in failed.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 1 and lines[-1] == errors[0], failed.output
    assert "no space left on device" in errors[0] and "free space" in errors[0], errors[0]
    assert "Traceback" not in failed.output and "never retrieved" not in failed.output
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [1]
    # no leftovers
    assert not [p for p in checkpoints_root(run_dir).iterdir() if p.name.startswith(".")]
    path, manifest, skipped = newest_checkpoint(run_dir)  # verified chunk by chunk
    assert manifest.step == 1 and not skipped

    resumed = runner.invoke(
        app, ["train", *QUICK, "--steps", "2", "--run-dir", str(run_dir), "--resume"]
    )
    assert resumed.exit_code == 0, resumed.output
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [1, 2]


def test_enospc_creating_the_checkpoints_directory_is_one_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    root = str(checkpoints_root(run_dir))
    mkdir = os.mkdir
    monkeypatch.setattr(
        os, "mkdir", lambda p, *a, **kw: enospc(p) if os.fspath(p) == root else mkdir(p, *a, **kw)
    )
    failed = CliRunner().invoke(app, ["train", *QUICK, "--steps", "1", "--run-dir", str(run_dir)])
    assert failed.exit_code == 2, failed.output
    lines = [line for line in failed.output.splitlines() if line.strip()]
    assert (
        lines[-1] == f"error: no space left on device creating {root}; free space or point "
        "--nvme-path/--run-dir at a larger filesystem"
    ), failed.output
    assert sum(line.startswith("error") for line in lines) == 1 and "Traceback" not in failed.output
