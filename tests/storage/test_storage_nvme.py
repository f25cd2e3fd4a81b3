"""NvmeStore beyond the conformance suite: zarr interop, corruption, ENOSPC, locks, orphans.

Faults are injected below the store (a flipped byte or truncated chunk on disk, an ENOSPC or
EIO from os.pwrite) and every test asserts that the previous version reads back exactly and
no temp file is left behind.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from test_storage_conformance import random_tensor, same_bytes
from tierzero.storage.base import (
    StorageCorruptError,
    StorageError,
    StorageFullError,
    StoreLockedError,
)
from tierzero.storage.io import IOLoop
from tierzero.storage.nvme import spares
from tierzero.storage.nvme.store import NvmeStore

CHUNK_BYTES = 16 << 10
KEY = "master/u0003/r0"


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def current_gen(root: Path, key: str) -> Path:
    """The generation directory the shard's group zarr.json names (its committed version)."""
    shard = root.joinpath(*key.split("/"))
    return (
        shard / json.loads((shard / "zarr.json").read_text())["attributes"]["tierzero"]["current"]
    )


def chunk_file(root: Path, key: str, index: int) -> Path:
    return current_gen(root, key) / "c" / str(index)


@pytest.fixture
def store(tmp_path: Path):
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as s:
        yield s


def test_zarr_reads_what_the_store_wrote(store: NvmeStore, tmp_path: Path, io_loop: IOLoop) -> None:
    shards = {
        "master/u0000/r0": random_tensor(torch.float32, 10_001, seed=1),
        "param/u0000/r0": random_tensor(torch.bfloat16, 10_001, seed=2),
        "grad/root/r1": random_tensor(torch.float16, 7, seed=3),
        "step/u0000/r0": torch.arange(9, dtype=torch.int64),
        "mask/u0000/r0": random_tensor(torch.bool, 33, seed=4),
    }
    for key, src in shards.items():
        io_loop.run(store.write(key, src))
    io_loop.run(store.flush())
    group = zarr.open_group(str(tmp_path), mode="r")
    for key, src in shards.items():
        array = group[key][current_gen(tmp_path, key).name]
        assert array.shape == (src.numel(),)
        assert array.attrs["tierzero"]["dtype"] == str(src.dtype).removeprefix("torch.")
        expected = (
            src.view(torch.int16).numpy().view(np.uint16)
            if src.dtype == torch.bfloat16
            else src.numpy()
        )
        np.testing.assert_array_equal(array[:], expected)
    assert sorted(group["master"].group_keys()) == ["u0000"]


def test_chunk_files_are_the_raw_bytes_padded(
    store: NvmeStore, tmp_path: Path, io_loop: IOLoop
) -> None:
    src = random_tensor(torch.float32, CHUNK_BYTES // 4 + 3, seed=7)
    io_loop.run(store.write(KEY, src))
    raw = src.view(torch.uint8).numpy().tobytes()
    assert chunk_file(tmp_path, KEY, 0).read_bytes() == raw[:CHUNK_BYTES]
    last = chunk_file(tmp_path, KEY, 1).read_bytes()
    assert last == raw[CHUNK_BYTES:] + bytes(CHUNK_BYTES - 12)


def test_overwrite_with_fewer_chunks_removes_the_stale_ones(
    store: NvmeStore, tmp_path: Path, io_loop: IOLoop
) -> None:
    io_loop.run(store.write(KEY, random_tensor(torch.float32, 3 * CHUNK_BYTES // 4, seed=1)))
    io_loop.run(store.write(KEY, random_tensor(torch.float32, 10, seed=2)))
    assert sorted(p.name for p in chunk_file(tmp_path, KEY, 0).parent.iterdir()) == ["0"]
    io_loop.run(store.flush())  # the superseded generation goes once the switch is durable
    assert [p.name for p in current_gen(tmp_path, KEY).parent.iterdir() if p.is_dir()] == [
        current_gen(tmp_path, KEY).name
    ]


def test_flipped_byte_is_named_on_a_verified_read(tmp_path: Path, io_loop: IOLoop) -> None:
    src = random_tensor(torch.float32, 3 * CHUNK_BYTES // 4, seed=1)
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        io_loop.run(store.write(KEY, src))
    path = chunk_file(tmp_path, KEY, 1)
    raw = bytearray(path.read_bytes())
    raw[1234] ^= 0x01
    path.write_bytes(raw)
    out = torch.empty_like(src)
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        with pytest.raises(
            StorageCorruptError,
            match=r"chunk 1 of shard 'master/u0003/r0' \(array .*master/u0003/r0/g",
        ):
            io_loop.run(store.read_into(KEY, out, verify=True))
        io_loop.run(store.read_into(KEY, out))  # unverified reads trust the disk
        assert not same_bytes(out, src)
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES, verify_reads=True) as store:
        with pytest.raises(StorageCorruptError, match="chunk 1 .* crc32c"):
            io_loop.run(store.read_into(KEY, out))


@pytest.mark.parametrize("keep", [CHUNK_BYTES // 2, CHUNK_BYTES - 1])
def test_truncated_chunk_is_named_even_unverified(
    store: NvmeStore, tmp_path: Path, io_loop: IOLoop, keep: int
) -> None:
    src = random_tensor(torch.float32, 3 * CHUNK_BYTES // 4, seed=1)
    io_loop.run(store.write(KEY, src))
    os.truncate(chunk_file(tmp_path, KEY, 2), keep)
    with pytest.raises(
        StorageCorruptError,
        match=r"chunk 2 of shard 'master/u0003/r0' \(array .*u0003/r0/g000001\) is truncated",
    ):
        io_loop.run(store.read_into(KEY, torch.empty_like(src)))


def test_missing_chunk_is_named(store: NvmeStore, tmp_path: Path, io_loop: IOLoop) -> None:
    src = random_tensor(torch.float32, 3 * CHUNK_BYTES // 4, seed=1)
    io_loop.run(store.write(KEY, src))
    chunk_file(tmp_path, KEY, 0).unlink()
    with pytest.raises(StorageCorruptError, match="chunk 0 .* is missing"):
        io_loop.run(store.read_into(KEY, torch.empty_like(src)))


def fail_nth(monkeypatch: pytest.MonkeyPatch, name: str, n: int, err: int) -> None:
    """Make the n-th call of os.<name> (counted from now) raise OSError(err)."""
    real = getattr(os, name)
    calls = iter(range(1 << 30))

    def failing(*args, **kwargs):
        if next(calls) == n:
            raise OSError(err, os.strerror(err))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, failing)


@pytest.mark.parametrize(
    "where",
    [("pwrite", 0), ("pwrite", 2), ("write", 0)],
    ids=["first-chunk", "third-chunk", "zarr-json"],
)
def test_enospc_keeps_the_previous_version_and_no_temp_file(
    store: NvmeStore,
    tmp_path: Path,
    io_loop: IOLoop,
    monkeypatch: pytest.MonkeyPatch,
    where: tuple[str, int],
) -> None:
    old = random_tensor(torch.float32, 4 * CHUNK_BYTES // 4, seed=1)
    new = random_tensor(torch.float32, 4 * CHUNK_BYTES // 4, seed=2)
    io_loop.run(store.write(KEY, old))
    fail_nth(monkeypatch, *where, errno.ENOSPC)
    with pytest.raises(StorageFullError, match=f"no space left in {tmp_path}.*{KEY}.*intact"):
        io_loop.run(store.write(KEY, new))
    monkeypatch.undo()
    assert temp_files(tmp_path) == []
    out = torch.empty_like(old)
    io_loop.run(store.read_into(KEY, out, verify=True))
    assert same_bytes(out, old)
    store.close()
    store.open()  # and from disk, not only from the cached metadata
    io_loop.run(store.read_into(KEY, out, verify=True))
    assert same_bytes(out, old)


def test_random_io_errors_never_tear_a_shard(
    store: NvmeStore, tmp_path: Path, io_loop: IOLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(0)
    real = os.pwrite

    def flaky(*args, **kwargs):
        if rng.random() < 0.15:
            raise OSError(errno.EIO, "injected")
        return real(*args, **kwargs)

    last = random_tensor(torch.float32, 5 * CHUNK_BYTES // 4, seed=0)
    io_loop.run(store.write(KEY, last))
    failures = 0
    for version in range(1, 25):
        src = random_tensor(torch.float32, 5 * CHUNK_BYTES // 4, seed=version)
        monkeypatch.setattr(os, "pwrite", flaky)
        try:
            io_loop.run(store.write(KEY, src))
            last = src
        except StorageError as e:
            assert "injected" in str(e)
            failures += 1
        monkeypatch.setattr(os, "pwrite", real)
        out = torch.empty_like(src)
        io_loop.run(store.read_into(KEY, out, verify=True))
        assert same_bytes(out, last)
        assert temp_files(tmp_path) == []
    assert 0 < failures < 24


def test_second_instance_in_the_same_process_is_refused(tmp_path: Path) -> None:
    with NvmeStore([tmp_path]):
        with pytest.raises(StoreLockedError, match=f"{tmp_path} is in use by .*pid {os.getpid()}"):
            NvmeStore([tmp_path]).open()
    with NvmeStore([tmp_path]):  # released on close
        pass


def test_second_process_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    # One child process (importing torch twice would double the test's time): it tries to
    # open the store, waits for a line on stdin, and tries again.
    script = (
        "import sys\n"
        "from tierzero.storage.nvme.store import NvmeStore\n"
        "from tierzero.storage.base import StoreLockedError\n"
        "for attempt in range(2):\n"
        "    try:\n"
        "        NvmeStore([sys.argv[1]]).open()\n"
        "        print('opened', flush=True)\n"
        "    except StoreLockedError as e:\n"
        "        print('refused:', e, flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    first = NvmeStore([tmp_path])
    first.open()
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        refused = child.stdout.readline()
        first.close()
        child.stdin.write("go\n")
        child.stdin.flush()
        reopened = child.stdout.readline()
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
    finally:
        first.close()
        if child.poll() is None:
            child.kill()
    assert refused.startswith("refused:")
    assert f"{tmp_path} is in use by another tierzero store (pid {os.getpid()})" in refused
    assert reopened == "opened\n"


def test_striped_store_locks_every_directory(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with NvmeStore([a, b]):
        with pytest.raises(StoreLockedError, match=str(b)):
            NvmeStore([b]).open()


def test_bad_paths_fail_at_open(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="does not exist: create it"):
        NvmeStore([tmp_path / "missing"]).open()
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(StorageError, match="is a regular file, not a directory"):
        NvmeStore([a_file]).open()
    with pytest.raises(StorageError, match="multiple of 4096"):
        NvmeStore([tmp_path], chunk_bytes=1000)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_path_fails_at_open(tmp_path: Path) -> None:
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(StorageError, match="not writable"):
            NvmeStore([tmp_path]).open()
    finally:
        tmp_path.chmod(0o755)


def test_failed_open_releases_the_directories_it_locked(tmp_path: Path) -> None:
    with pytest.raises(StorageError):
        NvmeStore([tmp_path, tmp_path / "missing"]).open()
    with NvmeStore([tmp_path]):
        pass


def refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Act like a filesystem without O_DIRECT (older tmpfs, some network filesystems)."""
    real = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)


def test_no_o_direct_falls_back_to_buffered_io(
    tmp_path: Path, io_loop: IOLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_o_direct(monkeypatch)
    with pytest.raises(StorageError, match="does not support O_DIRECT"):
        NvmeStore([tmp_path], direct=True).open()
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        assert not store.capabilities.direct_io
        src = random_tensor(torch.bfloat16, 12345, seed=1)
        io_loop.run(store.write(KEY, src))
        out = torch.empty_like(src)
        io_loop.run(store.read_into(KEY, out, verify=True))
        assert same_bytes(out, src)
    assert temp_files(tmp_path) == []


def test_open_removes_orphaned_temp_files(tmp_path: Path, io_loop: IOLoop) -> None:
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        io_loop.run(store.write(KEY, torch.zeros(100)))
    chunks = chunk_file(tmp_path, KEY, 0).parent
    orphan = chunks.parent.parent / ".zarr.json.99999-3.tmp"
    orphan.write_bytes(b"half a pointer")
    half_written = chunks.parent.parent / "g000002"  # a killed writer's next generation
    (half_written / "c").mkdir(parents=True)
    (half_written / "c" / "0").write_bytes(b"half a chunk")
    users_file = chunks.parent.parent / ".notes.tmp"  # not ours: left alone
    users_file.write_text("keep")
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        assert not orphan.exists()
        assert not half_written.exists()
        assert users_file.exists()
        out = torch.ones(100)
        io_loop.run(store.read_into(KEY, out, verify=True))
        assert (out == 0).all()


def test_overwrites_recycle_the_old_chunks_as_spares(
    store: NvmeStore, tmp_path: Path, io_loop: IOLoop
) -> None:
    first = random_tensor(torch.float32, 2 * CHUNK_BYTES // 4, seed=1)
    second = random_tensor(torch.float32, 2 * CHUNK_BYTES // 4, seed=2)
    io_loop.run(store.write(KEY, first))
    old_inodes = {chunk_file(tmp_path, KEY, i).stat().st_ino for i in range(2)}
    io_loop.run(store.write(KEY, second))
    spare_dir = tmp_path / spares.SPARE_DIR
    assert list(spare_dir.iterdir()) == []  # not before the switch is durable
    io_loop.run(store.flush())
    assert {p.stat().st_ino for p in spare_dir.iterdir()} == old_inodes  # recycled, not freed
    third = random_tensor(torch.float32, 2 * CHUNK_BYTES // 4, seed=3)
    io_loop.run(store.write(KEY, third))
    assert {chunk_file(tmp_path, KEY, i).stat().st_ino for i in range(2)} == old_inodes
    out = torch.empty_like(second)
    io_loop.run(store.read_into(KEY, out, verify=True))
    assert same_bytes(out, third)
    store.close()
    assert list(spare_dir.iterdir()) == []


KILL_SCRIPT = """\
import sys, torch
from tierzero.storage.io import IOLoop
from tierzero.storage.nvme.store import NvmeStore
shard = torch.empty(8 * int(sys.argv[2]), dtype=torch.uint8)
with IOLoop(4) as loop, NvmeStore([sys.argv[1]], chunk_bytes=int(sys.argv[2])) as store:
    version = 0
    while True:
        version = version % 250 + 1
        shard.fill_(version)
        loop.run(store.write("master/u0000/r0", shard))
        if version == 1:
            loop.run(store.flush())
            print("ready", flush=True)
"""


@pytest.mark.parametrize("attempt", range(3))
def test_sigkill_mid_write_leaves_one_whole_version(
    tmp_path: Path, io_loop: IOLoop, attempt: int
) -> None:
    """A writer killed at a random moment: after reopening, a verified read returns exactly one
    whole version (the last committed one), and no temp file or half generation is left."""
    chunk_bytes = 64 << 10
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(tmp_path), str(chunk_bytes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        time.sleep(random.Random(attempt).uniform(0.01, 0.2))
    finally:
        child.kill()
        child.wait(timeout=60)
    key = "master/u0000/r0"
    with NvmeStore([tmp_path], chunk_bytes=chunk_bytes) as store:  # the lock died with it
        assert temp_files(tmp_path) == []
        assert list((tmp_path / spares.SPARE_DIR).iterdir()) == []
        shard_dir = current_gen(tmp_path, key).parent
        assert [p.name for p in shard_dir.iterdir() if p.is_dir()] == [
            current_gen(tmp_path, key).name
        ]
        out = torch.empty(8 * chunk_bytes, dtype=torch.uint8)
        io_loop.run(store.read_into(key, out, verify=True))
        assert (out == out[0]).all() and 1 <= int(out[0]) <= 250


def test_a_verified_snapshot_never_links_a_flipped_bit_into_a_checkpoint(
    store: NvmeStore, tmp_path: Path, io_loop: IOLoop
) -> None:
    """A hard link shares the damage: a checkpoint that linked a flipped chunk would hold it too."""
    src = random_tensor(torch.float32, 3 * CHUNK_BYTES // 4, seed=4)
    io_loop.run(store.write(KEY, src))
    path = chunk_file(tmp_path, KEY, 2)
    raw = bytearray(path.read_bytes())
    raw[77] ^= 0x10
    path.write_bytes(raw)
    frozen = tmp_path.parent / f"{tmp_path.name}-checkpoint"
    with pytest.raises(
        StorageCorruptError,
        match=rf"{re.escape(str(current_gen(tmp_path, KEY)))}/c/2 fails its crc32c",
    ):
        io_loop.run(store.freeze(KEY, str(frozen / "a"), verify=True))
    assert not (frozen / "a").exists()
    io_loop.run(store.freeze(KEY, str(frozen / "b")))  # unverified: linked as it is
    assert os.path.samefile(frozen / "b" / "c" / "2", path)
