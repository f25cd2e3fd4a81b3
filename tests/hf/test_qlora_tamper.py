"""A damaged NF4 base is named, never trained on: with `verify_reads` on, a flipped byte in a
coded piece on the drive stops the step that would read it, naming the chunk; and a checkpoint
never hard-links a coded chunk damaged since it was written (every checkpoint of the run links
the same chunks, so a link would share the damage with all of them). The resume of a damaged
checkpoint is `test_hf_qlora.py`'s; the kill points of an NF4 base are `kill_sweep.PATHS`'.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tierzero.storage.base import StorageCorruptError
from tierzero.storage.nvme.generations import gen_name, read_pointer

from tests.hf.test_hf_qlora import batches, config, lora_model
from tests.support.hf import save_coded_base
from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.engine import Engine

KEY = "param/u0001/r0/p0001"  # the first block's frozen rest: its first coded piece


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return save_coded_base(tmp_path_factory.mktemp("qlora-tamper") / "base")


def flip_code(nvme: Path) -> Path:
    """Flip one bit of a code byte (past the piece's absmax) in the store's live chunk."""
    shard = nvme.joinpath(*KEY.split("/"))
    gen, _ = read_pointer(str(shard))
    path = shard / gen_name(gen) / "c" / "0"
    with open(path, "r+b") as f:
        f.seek(300)
        byte = f.read(1)
        f.seek(300)
        f.write(bytes([byte[0] ^ 0x10]))
    return path


def test_a_flipped_code_on_the_drive_stops_the_step_naming_it(base_dir, tmp_path) -> None:
    with Engine(lora_model(base_dir), config(tmp_path, verify_reads="on")) as engine:
        assert 1 in engine.parts.shards.coded  # the piece flipped is coded
        flip_code(tmp_path / "nvme")  # written at open, read by the first step's fetch
        with pytest.raises(StorageCorruptError, match=f"shard '{KEY}'.*fails its crc32c check"):
            engine.train_step(batches().next_batch())


def test_a_checkpoint_never_links_a_damaged_coded_chunk(base_dir, tmp_path) -> None:
    """The step read the codes into the host cache; the save checks the chunks it links."""
    with Engine(lora_model(base_dir), config(tmp_path, verify_reads="on")) as engine:
        engine.train_step(batches().next_batch())
        damaged = flip_code(tmp_path / "nvme")
        with pytest.raises(StorageCorruptError, match="fails its crc32c check"):
            engine.save_checkpoint(tmp_path / "run")
    assert checkpoint_dirs(tmp_path / "run") == [] and os.stat(damaged).st_nlink == 1
