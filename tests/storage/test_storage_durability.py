"""NvmeStore durability: all-or-nothing shard writes, reads that never outlive their buffer,
blocks recycled only when safe, and direct I/O fallbacks said out loud.

Faults are injected below the store (ENOSPC/EIO from os.pwrite or os.write at every chunk,
a process SIGKILLed between any two renames) and each test asserts that a verified read after
reopening returns one whole version, old or new, and that the error names the shard.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_storage_conformance import random_tensor, same_bytes
from test_storage_nvme import chunk_file, current_gen, fail_nth, temp_files
from tierzero.storage import durable
from tierzero.storage.base import StorageError, StorageFullError
from tierzero.storage.io import IOLoop
from tierzero.storage.nvme import chunkfile
from tierzero.storage.nvme import store as nvme
from tierzero.storage.nvme.spares import SPARE_DIR
from tierzero.storage.nvme.store import NvmeStore

CHUNK_BYTES = 16 << 10
NCHUNKS = 4
KEY = "exp_avg/u0002/r0"


def versions() -> tuple[torch.Tensor, torch.Tensor]:
    numel = NCHUNKS * CHUNK_BYTES // 4 - 5  # a partial last chunk too
    return random_tensor(torch.float32, numel, seed=1), random_tensor(torch.float32, numel, seed=2)


def read_back(root: Path, io_loop: IOLoop, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    with NvmeStore([root], chunk_bytes=CHUNK_BYTES) as store:  # from disk, not the cache
        io_loop.run(store.read_into(KEY, out, verify=True))
    return out


def only_current_generation(root: Path) -> bool:
    gen = current_gen(root, KEY)
    return [p.name for p in gen.parent.iterdir() if p.is_dir()] == [gen.name]


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
@pytest.mark.parametrize(
    "where",
    [("pwrite", i) for i in range(NCHUNKS)] + [("write", 0), ("write", 1)],
    ids=[f"chunk-{i}" for i in range(NCHUNKS)] + ["array-json", "pointer-json"],
)
def test_a_failed_write_at_any_chunk_keeps_the_old_version_whole(
    tmp_path: Path,
    io_loop: IOLoop,
    monkeypatch: pytest.MonkeyPatch,
    where: tuple[str, int],
    err: int,
) -> None:
    old, new = versions()
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        io_loop.run(store.write(KEY, old))
        fail_nth(monkeypatch, *where, err)
        expected = StorageFullError if err == errno.ENOSPC else StorageError
        with pytest.raises(expected, match=f"shard '{KEY}'.*previous version is intact"):
            io_loop.run(store.write(KEY, new))
        monkeypatch.undo()
        out = torch.empty_like(old)
        io_loop.run(store.read_into(KEY, out, verify=True))
        assert same_bytes(out, old)
        assert temp_files(tmp_path) == [] and only_current_generation(tmp_path)
        io_loop.run(store.write(KEY, new))  # and the store still works
    assert same_bytes(read_back(tmp_path, io_loop, new), new)


KILL_AT_SCRIPT = """\
import os, signal, sys, torch
from tierzero.storage.io import IOLoop
from tierzero.storage.nvme.store import NvmeStore
root, chunk_bytes, call, nth = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
numel = 4 * chunk_bytes // 4 - 5
old = torch.full((numel,), 1.0)
new = torch.full((numel,), 2.0)
with IOLoop(4) as loop, NvmeStore([root], chunk_bytes=chunk_bytes) as store:
    loop.run(store.write("exp_avg/u0002/r0", old))
    loop.run(store.flush())
    real, count = getattr(os, call), [0]
    def killing(*args, **kwargs):
        if count[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        count[0] += 1
        return real(*args, **kwargs)
    setattr(os, call, killing)
    loop.run(store.write("exp_avg/u0002/r0", new))
    print("finished", flush=True)
"""


@pytest.mark.parametrize(
    "where",
    [("pwrite", 0), ("pwrite", 3)] + [("rename", i) for i in range(NCHUNKS)] + [("replace", 0)],
    ids=["chunk-0-write", "chunk-3-write"]
    + [f"before-rename-{i}" for i in range(NCHUNKS)]
    + ["before-commit"],
)
def test_sigkill_between_any_two_steps_leaves_the_old_version_whole(
    tmp_path: Path, io_loop: IOLoop, where: tuple[str, int]
) -> None:
    """A writer SIGKILLed before any of its chunk writes or renames, or just before the
    commit rename: the old version reads back whole, and reopening removes the half-made
    generation."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            KILL_AT_SCRIPT,
            str(tmp_path),
            str(CHUNK_BYTES),
            where[0],
            str(where[1]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -9, done.stderr
    old = torch.full((NCHUNKS * CHUNK_BYTES // 4 - 5,), 1.0)
    assert same_bytes(read_back(tmp_path, io_loop, old), old)
    assert temp_files(tmp_path) == [] and only_current_generation(tmp_path)


def test_a_read_that_fails_returns_only_after_every_thread_let_go_of_the_buffer(
    tmp_path: Path, io_loop: IOLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk 0 fails at once while the others are still reading: read_into must not raise
    (and hand the buffer back to its owner) while a sibling thread can still write into it."""
    src = random_tensor(torch.float32, 8 * CHUNK_BYTES // 4, seed=3)
    active = []  # chunk reads in progress
    lock = threading.Lock()
    real = chunkfile.read_chunk

    def slow_or_failing(path, out, chunk_bytes, direct):
        if path.endswith(os.sep + "0"):
            raise OSError(errno.EIO, "injected")
        with lock:
            active.append(path)
        try:
            time.sleep(0.2)
            real(path, out, chunk_bytes, direct)
        finally:
            with lock:
                active.remove(path)

    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        io_loop.run(store.write(KEY, src))
        monkeypatch.setattr(chunkfile, "read_chunk", slow_or_failing)
        with pytest.raises(StorageError, match=f"chunk 0 of shard '{KEY}'.*injected"):
            io_loop.run(store.read_into(KEY, torch.empty_like(src)))
        with lock:
            assert active == []  # nobody writes into the buffer after the error


def test_a_cancelled_write_returns_only_after_its_workers_finished(
    tmp_path: Path, io_loop: IOLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = versions()
    active = []
    real = chunkfile.write_chunk

    def slow(path, data, chunk_bytes, direct):
        active.append(path)
        try:
            time.sleep(0.2)
            real(path, data, chunk_bytes, direct)
        finally:
            active.remove(path)

    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        io_loop.run(store.write(KEY, old))
        monkeypatch.setattr(chunkfile, "write_chunk", slow)

        async def cancel_midway() -> None:
            task = asyncio.ensure_future(store.write(KEY, new))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert active == []  # no thread still reads the caller's buffer

        io_loop.run(cancel_midway())
        monkeypatch.undo()
        out = torch.empty_like(old)
        io_loop.run(store.read_into(KEY, out, verify=True))
        assert same_bytes(out, old)
    assert only_current_generation(tmp_path) and temp_files(tmp_path) == []


def test_chunks_a_snapshot_links_are_never_recycled_or_overwritten(
    tmp_path: Path, io_loop: IOLoop
) -> None:
    live, frozen = tmp_path / "live", tmp_path / "frozen"
    live.mkdir()
    first = random_tensor(torch.float32, 2 * CHUNK_BYTES // 4, seed=1)
    with NvmeStore([live], chunk_bytes=CHUNK_BYTES) as store:
        io_loop.run(store.write(KEY, first))
        io_loop.run(store.flush())
        meta, copied = io_loop.run(store.freeze(KEY, str(frozen)))
        assert copied == 0  # hard links: no bytes moved
        linked = {p.stat().st_ino for p in (frozen / "c").iterdir()}
        for seed in range(2, 6):  # several rewrites, each flushed so retired blocks recycle
            io_loop.run(
                store.write(KEY, random_tensor(torch.float32, 2 * CHUNK_BYTES // 4, seed=seed))
            )
            io_loop.run(store.flush())
        assert not linked & {p.stat().st_ino for p in (live / SPARE_DIR).iterdir()}
    from tierzero.storage.nvme.arrays import read_array

    assert same_bytes(read_array(str(frozen), meta), first)


def test_adopting_a_snapshot_restores_it_by_links(tmp_path: Path, io_loop: IOLoop) -> None:
    live, frozen = tmp_path / "live", tmp_path / "frozen"
    live.mkdir()
    first, second = versions()
    with NvmeStore([live], chunk_bytes=CHUNK_BYTES) as store:
        io_loop.run(store.write(KEY, first))
        meta, _ = io_loop.run(store.freeze(KEY, str(frozen)))
        io_loop.run(store.write(KEY, second))
        assert io_loop.run(store.adopt(KEY, str(frozen), meta)) == 0
        io_loop.run(store.flush())
        assert chunk_file(live, KEY, 0).stat().st_nlink == 2
    assert same_bytes(read_back(live, io_loop, first), first)


def test_pwrite_that_makes_no_progress_is_an_error_not_a_spin(
    tmp_path: Path, io_loop: IOLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = versions()
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        io_loop.run(store.write(KEY, old))
        monkeypatch.setattr(os, "pwrite", lambda *a, **k: 0)
        with pytest.raises(StorageError, match="wrote 0 bytes"):
            io_loop.run(store.write(KEY, new))
        monkeypatch.undo()
        out = torch.empty_like(old)
        io_loop.run(store.read_into(KEY, out, verify=True))
        assert same_bytes(out, old)


def test_a_failed_delete_is_reported(
    tmp_path: Path, io_loop: IOLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        io_loop.run(store.write(KEY, torch.zeros(10)))

        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, "injected")

        monkeypatch.setattr(nvme.shutil, "rmtree", refuse)
        with pytest.raises(StorageError, match=f"deleting shard '{KEY}'.*injected"):
            io_loop.run(store.delete(KEY))
        monkeypatch.undo()
        io_loop.run(store.delete(KEY))
        assert not io_loop.run(store.exists(KEY))


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_tmpfs_is_never_reported_as_direct_io(tmp_path: Path) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        with NvmeStore([shm], chunk_bytes=CHUNK_BYTES) as store:
            assert not store.capabilities.direct_io
            assert any("tmpfs" in n and "buffered" in n for n in store.notes)
        with pytest.raises(StorageError, match="does not support O_DIRECT"):
            NvmeStore([shm], direct=True).open()


def test_an_unaligned_buffer_is_said_once(tmp_path: Path, io_loop: IOLoop) -> None:
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        if not store.capabilities.direct_io:
            pytest.skip("this filesystem has no direct I/O")
        backing = torch.zeros(CHUNK_BYTES // 4 + 1024)
        unaligned = backing[1 : 1 + CHUNK_BYTES // 4]
        for _ in range(3):
            io_loop.run(store.write(KEY, unaligned))
        assert sum("not aligned" in n for n in store.notes) == 1


class MetadataCalls:
    """Records os.fsync (by the path its descriptor names) and os.replace, in call order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            self.calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def replace(src: str, dst: str) -> None:
            self.calls.append(("replace", str(dst)))
            real_replace(src, dst)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def around(self, final: Path) -> list[tuple[str, str]]:
        """The calls that touched `final`: its temp file's fsync, its rename, its directory's
        fsync."""
        temp = re.compile(re.escape(f"{final.parent}/.{final.name}.") + r"\d+-\d+\.tmp")
        return [
            ("fsync temp" if temp.fullmatch(path) else what, path)
            for what, path in self.calls
            if temp.fullmatch(path) or path in (str(final), str(final.parent))
        ]


def test_a_metadata_file_is_fsynced_then_renamed_then_its_directory_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = MetadataCalls(monkeypatch)
    final = tmp_path / "zarr.json"
    durable.write_atomic(str(final), b"{}")
    temp_name = calls.calls[0][1]
    assert calls.calls == [("fsync", temp_name), ("replace", str(final)), ("fsync", str(tmp_path))]
    assert final.read_bytes() == b"{}" and not Path(temp_name).exists()


def test_the_store_fsyncs_its_group_files_and_every_commit_pointer_before_the_rename(
    tmp_path: Path, io_loop: IOLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = MetadataCalls(monkeypatch)
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        src = random_tensor(torch.float32, 2 * CHUNK_BYTES // 4, seed=3)
        io_loop.run(store.write(KEY, src))
        io_loop.run(store.write(KEY, src))
    *groups, shard = [tmp_path.joinpath(*KEY.split("/")[:n]) for n in range(KEY.count("/") + 2)]
    for group in groups:  # the root group and one per key prefix: written once, durably
        assert [what for what, _ in calls.around(group / "zarr.json")] == [
            "fsync temp",
            "replace",
            "fsync",
        ], group
    # the commit pointer: fsynced before each rename; the rename is made durable by flush()
    assert [what for what, _ in calls.around(shard / "zarr.json")] == ["fsync temp", "replace"] * 2
