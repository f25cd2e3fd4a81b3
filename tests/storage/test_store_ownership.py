"""Stores own their paths: a store directory inside or above another store's -- live or closed --
is refused before anything is written, naming both; start-up cleanup never walks into another
store; and a FIFO where a store's pointer belongs is named, never waited on."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from tierzero.storage.base import StorageCorruptError, StorageError
from tierzero.storage.io import IOLoop
from tierzero.storage.nvme.dirlock import OWNER_NAME, is_store_root
from tierzero.storage.nvme.generations import remove_orphans
from tierzero.storage.nvme.store import NvmeStore

CHUNK_BYTES = 16 << 10
KEY = "master/u0005/r0/p0000"
HANG_GUARD_S = 120  # a guard against a hang, not a timing threshold


def files_under(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("live", [True, False])
def test_a_store_above_another_is_refused_before_anything_is_written(
    tmp_path: Path, io_loop: IOLoop, live: bool
) -> None:
    outer, inner = tmp_path / "p", tmp_path / "p" / "a"
    inner.mkdir(parents=True)
    a = NvmeStore([inner], chunk_bytes=CHUNK_BYTES)
    a.open()
    try:
        io_loop.run(a.write(KEY, torch.arange(5000, dtype=torch.float32)))
        # A's own, in flight (its cleanup's to remove)
        orphan = inner / "master" / ".zarr.json.99999-3.tmp"
        orphan.write_bytes(b"in flight")
        if not live:
            a.close()
        before = files_under(inner)
        with pytest.raises(StorageError, match=f"{outer} holds the store directory {inner}"):
            NvmeStore([outer], chunk_bytes=CHUNK_BYTES).open()
        assert files_under(inner) == before  # nothing of A's removed
        assert sorted(p.name for p in outer.iterdir()) == ["a"]  # nothing of B's written
        if live:
            out = torch.empty(5000)
            io_loop.run(a.read_into(KEY, out, verify=True))
            assert torch.equal(out, torch.arange(5000, dtype=torch.float32))
    finally:
        a.close()


def test_a_store_inside_another_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    outer, inner = tmp_path / "p", tmp_path / "p" / "a"
    outer.mkdir()
    with NvmeStore([outer], chunk_bytes=CHUNK_BYTES):
        assert is_store_root(outer) and (outer / OWNER_NAME).is_file()
        inner.mkdir()
        with pytest.raises(StorageError, match=f"{inner} lies inside the store directory {outer}"):
            NvmeStore([inner], chunk_bytes=CHUNK_BYTES).open()
        assert list(inner.iterdir()) == []


def test_start_up_cleanup_never_walks_into_another_store(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "ours" / "x" / "theirs"
    (theirs / "g000002").mkdir(parents=True)  # a generation its pointer does not name
    (theirs / "zarr.json").write_text('{"attributes": {"tierzero": {"current": "g000001"}}}')
    (theirs / OWNER_NAME).write_text("{}")
    in_flight = theirs / ".zarr.json.12345-0.tmp"
    in_flight.write_bytes(b"theirs")
    remove_orphans(str(ours), foreign=is_store_root)
    assert in_flight.exists() and (theirs / "g000002").is_dir()


def test_a_fifo_for_a_shard_pointer_is_named_not_waited_on(tmp_path: Path, io_loop: IOLoop) -> None:
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        io_loop.run(store.write(KEY, torch.zeros(100)))
    pointer = tmp_path.joinpath(*KEY.split("/"), "zarr.json")
    pointer.unlink()
    os.mkfifo(pointer)
    reopened = NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES)
    opening = threading.Thread(target=reopened.open, daemon=True)
    opening.start()
    opening.join(HANG_GUARD_S)
    assert not opening.is_alive(), "opening the store waited on a FIFO"
    try:
        with pytest.raises(StorageCorruptError, match=f"{pointer} is a FIFO, not a regular file"):
            io_loop.run(reopened.read_into(KEY, torch.empty(100)))
    finally:
        reopened.close()
