"""Power-loss ordering of a checkpoint save, recorded at the system calls.

A checkpoint survives a power loss only if its steps reach the disk in this order: the store's
flush (the chunks about to be linked are durable), the hard links into the temp directory, a
syncfs of the checkpoint's filesystem (links and directories), the manifest's fsync, the rename
of the temp directory to `step-<N>` (the commit point), and an fsync of `checkpoints/` (the
rename itself). The recorder wraps the calls the code really makes (`syncfs` through
`chunkfile.syncfs`, `os.link`, `os.fsync`, `os.rename`) and classifies each by its path; the
checker accepts only that order. Each step made a no-op in turn must make the checker refuse.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_checkpoint_resume import PLACEMENTS, config, engine_for
from tierzero.storage.nvme import chunkfile

from tests.support.engine import batches
from tierzero.checkpoint.catalog import checkpoints_root
from tierzero.checkpoint.manifest import MANIFEST_NAME

STEPS = ("flush", "link", "syncfs", "manifest fsync", "rename", "dir fsync")


def fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


class SaveRecorder:
    """The ordered steps of one save, as seen at the system calls; `skip` ones become no-ops."""

    def __init__(self, store_dir: Path, run_dir: Path, skip: str | None = None) -> None:
        self.store_dir, self.root, self.skip = str(store_dir), str(checkpoints_root(run_dir)), skip
        self.events: list[str] = []

    def _temp(self, path: str) -> bool:
        return path.startswith(self.root + "/.step-")

    def _step(self, name: str | None) -> bool:
        """Record `name`; False when the call must be skipped."""
        if name is None:
            return True
        if name == self.skip:
            return False
        self.events.append(name)
        return True

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        syncfs, link, fsync, rename = chunkfile.syncfs, os.link, os.fsync, os.rename

        def on_syncfs(fd: int) -> int:
            path = fd_path(fd)
            name = (
                "flush"
                if path.startswith(self.store_dir)
                else "syncfs"
                if self._temp(path)
                else None
            )
            return syncfs(fd) if self._step(name) else 0

        def on_link(src, dst, *a, **kw):
            if self._step("link" if self._temp(os.fspath(dst)) else None):
                link(src, dst, *a, **kw)

        def on_fsync(fd: int) -> None:
            path = fd_path(fd)
            name = (
                "manifest fsync"
                if self._temp(path) and path.endswith("/" + MANIFEST_NAME)
                else "dir fsync"
                if path == self.root
                else None
            )
            if self._step(name):
                fsync(fd)

        def on_rename(src, dst, *a, **kw):
            if self._step("rename" if self._temp(os.fspath(src)) else None):
                rename(src, dst, *a, **kw)

        assert syncfs is not None, "this test needs syncfs (Linux)"
        monkeypatch.setattr(chunkfile, "syncfs", on_syncfs)
        monkeypatch.setattr(os, "link", on_link)
        monkeypatch.setattr(os, "fsync", on_fsync)
        monkeypatch.setattr(os, "rename", on_rename)


def check_order(events: list[str]) -> None:
    """Raise AssertionError unless `events` are the power-loss-safe order of one save."""
    firsts = {step: events.index(step) for step in STEPS if step in events}
    missing = [step for step in STEPS if step not in firsts]
    assert not missing, f"the save never made {missing}: {events}"
    lasts = {step: len(events) - 1 - events[::-1].index(step) for step in STEPS}
    for before, after in zip(STEPS, STEPS[1:]):
        assert lasts[before] < firsts[after], f"{before} must precede {after}: {events}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    """One trained engine whose store every test's saves link from (each into its own run dir)."""
    root = tmp_path_factory.mktemp("order")
    with engine_for(config(root, PLACEMENTS["everything-on-nvme"])) as engine:
        engine.train_step(batches().next_batch())
        yield engine


def record_save(
    engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skip: str | None
) -> list[str]:
    run_dir = tmp_path / "run"
    recorder = SaveRecorder(Path(engine.config.tiering.nvme_path[0]), run_dir, skip)
    with monkeypatch.context() as patch:
        recorder.install(patch)
        engine.save_checkpoint(run_dir)
    return recorder.events


def test_a_save_flushes_links_syncs_fsyncs_the_manifest_renames_then_fsyncs_the_directory(
    engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = record_save(engine, tmp_path, monkeypatch, skip=None)
    check_order(events)
    assert events.count("rename") == 1 and events[-1] == "dir fsync"


@pytest.mark.parametrize("step", STEPS)
def test_a_save_without_any_one_step_is_refused_by_the_checker(
    engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    events = record_save(engine, tmp_path, monkeypatch, skip=step)
    with pytest.raises(AssertionError, match=step):
        check_order(events)


@pytest.mark.parametrize("late", ["flush", "syncfs", "manifest fsync"])
def test_a_step_out_of_order_is_refused_by_the_checker(late: str) -> None:
    events = [s for s in STEPS if s != late]
    events.insert(events.index("rename") + 1, late)
    with pytest.raises(AssertionError, match="must precede"):
        check_order(events)
