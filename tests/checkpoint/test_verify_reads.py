"""Reads you can trust: with `verify_reads` on, a flipped bit in a live chunk stops training with
the chunk named instead of being trained on, and a checkpoint never hard-links a damaged chunk
(a link would share the damage); `auto` turns it on where crc32c outruns the store's reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_checkpoint_resume import PLACEMENTS, config, engine_for
from tierzero.cli.app import app
from tierzero.storage.base import StorageCorruptError
from tierzero.storage.nvme import chunkfile
from tierzero.storage.nvme.generations import gen_name, read_pointer
from tierzero.storage.nvme.store import NvmeStore
from typer.testing import CliRunner

from tests.support.engine import batches
from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.config import Config
from tierzero.errors import ConfigError

KEY = "master/u0001/r0/p0000"


def flip_live_chunk(nvme: Path, key: str = KEY) -> Path:
    """Flip one byte of chunk 0 of the store's current generation of `key`, in place."""
    shard = nvme.joinpath(*key.split("/"))
    gen, _ = read_pointer(str(shard))
    path = shard / gen_name(gen) / "c" / "0"
    with open(path, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x01]))
    return path


def trained(tmp_path: Path, verify_reads: str):
    engine = engine_for(
        config(tmp_path, PLACEMENTS["everything-on-nvme"], verify_reads=verify_reads)
    )
    engine.open()
    engine.train_step(batches().next_batch())
    return engine


def test_a_flipped_bit_stops_the_next_step_naming_the_chunk(tmp_path: Path) -> None:
    engine = trained(tmp_path, "on")
    try:
        flip_live_chunk(tmp_path / "nvme")
        with pytest.raises(
            StorageCorruptError, match=f"chunk 0 of shard '{KEY}'.*fails its crc32c check"
        ):
            engine.train_step(batches().next_batch())
    finally:
        engine.close()


def test_without_verification_the_flipped_bit_is_trained_on(tmp_path: Path) -> None:
    engine = trained(tmp_path, "off")
    try:
        flip_live_chunk(tmp_path / "nvme")
        engine.train_step(batches().next_batch())  # what verify_reads exists to stop
    finally:
        engine.close()


def test_a_checkpoint_never_links_a_chunk_damaged_since_it_was_written(tmp_path: Path) -> None:
    """The step just wrote every master shard; nothing read them since. The save checks them."""
    engine = trained(tmp_path, "on")
    try:
        damaged = flip_live_chunk(tmp_path / "nvme")
        with pytest.raises(StorageCorruptError, match="fails its crc32c check"):
            engine.save_checkpoint(tmp_path / "run")
        assert checkpoint_dirs(tmp_path / "run") == [] and os.stat(damaged).st_nlink == 1
    finally:
        engine.close()


@pytest.mark.parametrize("crc_rate,expected", [(100e9, True), (10e9, False)])
def test_auto_verifies_where_crc32c_outruns_the_reads_twenty_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crc_rate: float, expected: bool
) -> None:
    monkeypatch.setattr(chunkfile, "crc32c_rate", lambda nbytes=0: crc_rate)
    monkeypatch.setattr(chunkfile, "read_rate", lambda directory, nbytes, direct: 2e9)
    store = NvmeStore([tmp_path], chunk_bytes=1 << 16, verify_reads=None)
    with store:
        assert store.verify_reads is expected
    # off stays off, unmeasured
    assert NvmeStore([tmp_path], verify_reads=False).verify_reads is False


def test_the_probes_measure_real_rates(tmp_path: Path) -> None:
    assert chunkfile.crc32c_rate(1 << 16) > 0
    assert chunkfile.read_rate(str(tmp_path), 1 << 16, direct=False) > 0
    assert os.listdir(tmp_path) == []  # the probe file is gone


def test_bad_values_are_refused_in_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="verify_reads must be auto, on or off, got 'yes'"):
        Config(verify_reads="yes")
    result = CliRunner().invoke(
        app, ["train", "--steps", "1", "--verify-reads", "yes", "--run-dir", str(tmp_path)]
    )
    assert (
        result.exit_code == 2
        and result.output.strip() == "error: --verify-reads must be auto, on or off, got 'yes'"
    )
