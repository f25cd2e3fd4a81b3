"""Storage's error paths: one domain error per failed call, and nothing left behind for asyncio
to complain about.

A store call that fails in many chunk jobs at once (ENOSPC mid-write, a shard whose chunks are
gone) raises one error; every other failed job's exception is retrieved, so no "Future exception
was never retrieved" is logged when the futures are collected. An OSError from the file system
(ENOSPC, EACCES, EIO) in a frozen array's write or link, or a manifest's write, is one sentence
naming the path and the fix, a `StorageError` the CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_storage_conformance import random_tensor
from tierzero.cli.app import app
from tierzero.storage.base import StorageCorruptError, StorageError, StorageFullError
from tierzero.storage.io import IOLoop, write_durable
from tierzero.storage.nvme import chunkfile
from tierzero.storage.nvme.arrays import link_array, write_array
from tierzero.storage.nvme.store import NvmeStore
from typer.testing import CliRunner

CHUNK_BYTES = 16 << 10
KEY = "master/u0003/r0"
NCHUNKS = 32


def enospc(*args: object, **kwargs: object) -> int:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def failing(err: int):  # type: ignore[no-untyped-def]
    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(err, os.strerror(err))

    return fail


def asyncio_complaints(io_loop: IOLoop, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Collect the failed call's futures and return what asyncio reported about them."""
    reported: list[str] = []
    io_loop.loop.set_exception_handler(lambda loop, context: reported.append(context["message"]))
    gc.collect()
    return reported + [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_enospc_in_every_chunk_raises_one_error_and_asyncio_reports_nothing(
    tmp_path: Path,
    io_loop: IOLoop,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncio")
    src = random_tensor(torch.float32, NCHUNKS * CHUNK_BYTES // 4, seed=1)
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        monkeypatch.setattr(os, "pwrite", enospc)
        with pytest.raises(StorageFullError, match="no space left"):
            io_loop.run(store.write(KEY, src))
        monkeypatch.undo()
        assert asyncio_complaints(io_loop, caplog) == []


def test_a_read_of_deleted_chunks_raises_one_error_and_asyncio_reports_nothing(
    tmp_path: Path, io_loop: IOLoop, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncio")
    src = random_tensor(torch.float32, NCHUNKS * CHUNK_BYTES // 4, seed=2)
    with NvmeStore([tmp_path], chunk_bytes=CHUNK_BYTES) as store:
        io_loop.run(store.write(KEY, src))
        shutil.rmtree(Path(store.array_dir(KEY)) / "c")
        with pytest.raises(StorageCorruptError, match="is missing"):
            io_loop.run(store.read_into(KEY, torch.empty_like(src)))
        assert asyncio_complaints(io_loop, caplog) == []


FIXES = {
    errno.ENOSPC: "no space left on device writing {path}; free space or point "
    "--nvme-path/--run-dir at a larger filesystem",
    errno.EACCES: "permission denied writing {path} (Permission denied); make it writable "
    "or point --nvme-path/--run-dir at a writable filesystem",
    errno.EIO: "writing {path} failed (Input/output error); check the drive (dmesg) or "
    "point --nvme-path/--run-dir at another filesystem",
}


@pytest.mark.parametrize("err", list(FIXES), ids=[errno.errorcode[e] for e in FIXES])
def test_a_failed_array_write_is_one_sentence_naming_the_chunk_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    monkeypatch.setattr(os, "pwrite", failing(err))
    with pytest.raises(StorageError) as caught:
        write_array(str(tmp_path / "a"), torch.ones(CHUNK_BYTES // 4), CHUNK_BYTES)
    assert str(caught.value) == FIXES[err].format(path=tmp_path / "a" / "c" / "0")
    assert isinstance(caught.value, StorageFullError) == (err == errno.ENOSPC)


def test_a_failed_array_link_names_the_link_it_could_not_make(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = write_array(str(tmp_path / "src"), torch.ones(CHUNK_BYTES // 4), CHUNK_BYTES)

    def link(src: str, dst: str) -> None:  # as os.link reports it: both names
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), src, None, dst)

    monkeypatch.setattr(os, "link", link)
    with pytest.raises(
        StorageFullError,
        match=f"^no space left on device linking {tmp_path / 'dst' / 'c' / '0'}; free space",
    ):
        link_array(str(tmp_path / "src"), str(tmp_path / "dst"), meta)


def test_linking_an_array_with_a_missing_chunk_names_the_chunk(tmp_path: Path) -> None:
    meta = write_array(str(tmp_path / "src"), torch.ones(CHUNK_BYTES // 2), CHUNK_BYTES)
    (tmp_path / "src" / "c" / "1").unlink()
    with pytest.raises(StorageCorruptError, match=f"^{tmp_path / 'src' / 'c' / '1'} is missing"):
        link_array(str(tmp_path / "src"), str(tmp_path / "dst"), meta)


def test_a_failed_manifest_write_names_the_manifest(
    tmp_path: Path, io_loop: IOLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "fsync", failing(errno.ENOSPC))
    path = tmp_path / "manifest.json"
    with pytest.raises(StorageFullError, match=f"^no space left on device writing {path};"):
        io_loop.run(write_durable(str(path), b"{}"))


def test_enospc_while_checkpointing_host_state_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train --offload host` writes host-held state into its checkpoint with `write_array`."""
    monkeypatch.setattr(chunkfile, "write_chunk", failing(errno.ENOSPC))
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--steps",
            "2",
            "--checkpoint-every",
            "2",
            "--offload",
            "host",
            "--run-dir",
            str(tmp_path / "run"),
        ],
    )
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0] == result.output.strip().splitlines()[-1], result.output
    assert errors[0].startswith("error: no space left on device writing ") and errors[0].endswith(
        "/c/0; free space or point --nvme-path/--run-dir at a larger filesystem"
    ), result.output
    assert "Traceback" not in result.output and "never retrieved" not in result.output
