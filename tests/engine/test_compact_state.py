"""Compact optimizer state through the engine: what each tier stores, checkpoints that resume
bitwise, verify and export, and the fp32 default left as torch's AdamW."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from safetensors.torch import load_file
from tierzero.cli.app import app
from typer.testing import CliRunner

from tests.support.checkpoints import flip_byte
from tests.support.engine import SMALL, assert_same, batches
from tierzero import Config, Placement, Tier, models
from tierzero.checkpoint.export import export_checkpoint
from tierzero.checkpoint.inspect import inspect_run
from tierzero.checkpoint.manifest import MANIFEST_NAME, Manifest
from tierzero.compact.formats import INT8_CODES, StateFormats
from tierzero.config import STATE_BLOCK, StateKind
from tierzero.engine import Engine
from tierzero.errors import CheckpointError

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
# master and moments in host memory
HOST = Placement(Tier.NVME, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)
# device memory (host RAM on the CPU device)
GPU = Placement(Tier.GPU, Tier.GPU, Tier.GPU, Tier.GPU, Tier.GPU)
PIECE = 16384  # several pieces per block unit, each of 64 quantisation blocks


def _config(
    nvme: Path,
    placement: Placement = NVME,
    moments: str = "int8",
    master: str = "bf16",
    **extra: Any,
) -> Config:
    return Config(
        placement=placement,
        nvme_path=[str(nvme)],
        lr=3e-3,
        total_steps=6,
        piece_numel=PIECE,
        optimizer_state=moments,
        master=master,
        **extra,
    )


def _engine(config: Config) -> Engine:
    return Engine(models.build(SMALL, device="meta", seed=0), config)


def _moments(engine: Engine) -> list[torch.Tensor]:
    kinds = (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    return [engine.read_shard(kind, unit) for unit in engine.units for kind in kinds]


def _current(root: Path, key: str) -> Path:
    shard = root.joinpath(*key.split("/"))
    return (
        shard / json.loads((shard / "zarr.json").read_text())["attributes"]["tierzero"]["current"]
    )


def test_the_nvme_store_holds_compact_pieces_that_zarr_reads(tmp_path: Path) -> None:
    config = _config(tmp_path / "nvme")
    data = batches()
    with _engine(config) as engine:
        for _ in range(2):
            engine.train_step(data.next_batch())
        unit = engine.units[1]
        key, a, b = engine.keys(StateKind.EXP_AVG, unit)[0]
        moment = engine.read_shard(StateKind.EXP_AVG, unit)[a:b]
        master = engine.read_shard(StateKind.MASTER, unit)
        master_key, ma, mb = engine.keys(StateKind.MASTER, unit)[0]
    root = tmp_path / "nvme"
    array = zarr.open_array(str(_current(root, key)), mode="r")
    assert array.attrs["tierzero"]["dtype"] == "uint8" and array.shape == (
        4 * PIECE // STATE_BLOCK + PIECE,
    )  # absmax, then codes
    packed = torch.from_numpy(np.asarray(array[:]))
    formats = StateFormats.of(config.formats)
    assert torch.equal(formats.decode(StateKind.EXP_AVG, packed, torch.empty(b - a)), moment)
    # the attributes say how to decode it, with numpy alone
    layout, raw = array.attrs["tierzero"]["layout"], np.asarray(array[:])
    scales, codes = layout["scales"], layout["codes"]
    absmax = raw[scales["offset"] : scales["offset"] + 4 * scales["count"]].view("<f4")
    index = raw[codes["offset"] : codes["offset"] + codes["count"]]
    values = (
        np.asarray(layout["code_map"]["values"], dtype=np.float32)[index]
        * np.repeat(absmax, layout["block"])[: index.size]
    )
    assert layout["code_map"]["signed"] and torch.equal(torch.from_numpy(values), moment)
    bf16 = zarr.open_array(str(_current(root, master_key)), mode="r")
    assert bf16.attrs["tierzero"]["dtype"] == "bfloat16" and bf16.shape == (mb - ma,)
    assert torch.equal(
        torch.from_numpy(np.asarray(bf16[:]).view(np.int16)).view(torch.bfloat16).float(),
        master[ma:mb],
    )
    assert not torch.equal(moment, torch.zeros_like(moment))  # the steps wrote them


@pytest.mark.parametrize(
    "placement,moments,master,dtype",
    [
        (NVME, "int8", "bf16", "fp32"),
        (HOST, "bf16", "fp32", "fp32"),
        (GPU, "fp32", "bf16", "fp32"),
        (NVME, "int8", "bf16", "bf16"),
        (GPU, "int8", "bf16", "bf16"),
    ],
)
def test_a_compact_run_resumes_bitwise(
    tmp_path: Path, placement: Placement, moments: str, master: str, dtype: str
) -> None:
    """With bf16 compute a bf16 master is the param itself: no master key in the store or the
    checkpoint."""
    data = batches()
    steps = [data.next_batch() for _ in range(4)]
    with _engine(_config(tmp_path / "a", placement, moments, master, dtype=dtype)) as engine:
        for batch in steps[:2]:
            engine.train_step(batch)
        engine.save_checkpoint(tmp_path / "run")
        saved = engine.master_state_dict()
        assert (engine.keys(StateKind.MASTER, engine.units[1]) == []) == (master == dtype == "bf16")
        for batch in steps[2:]:
            engine.train_step(batch)
        straight, straight_moments = engine.master_state_dict(), _moments(engine)
    masters = list((tmp_path / "run").glob("checkpoints/step-*/state/master"))
    assert len(masters) == (0 if master == dtype == "bf16" else 1)
    export_checkpoint(tmp_path / "run", tmp_path / "model.safetensors")
    assert_same(load_file(str(tmp_path / "model.safetensors")), saved)
    with _engine(_config(tmp_path / "b", placement, moments, master, dtype=dtype)) as engine:
        engine.load_checkpoint(tmp_path / "run")
        for batch in steps[2:]:
            engine.train_step(batch)
        assert_same(engine.master_state_dict(), straight)
        for got, want in zip(_moments(engine), straight_moments):
            assert torch.equal(got, want)


def test_a_compact_checkpoint_verifies_exports_and_refuses_another_format(tmp_path: Path) -> None:
    data = batches()
    with _engine(_config(tmp_path / "nvme")) as engine:
        for _ in range(2):
            engine.train_step(data.next_batch())
        engine.save_checkpoint(tmp_path / "run")
        weights = engine.master_state_dict()
    info = inspect_run(tmp_path / "run", verify=True)
    assert [(c.step, c.status) for c in info.checkpoints] == [(2, "ok")]
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "run"), "--verify", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["checkpoints"][0]["status"] == "ok"
    export_checkpoint(tmp_path / "run", tmp_path / "model.safetensors")
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert all(
        exported[k].dtype == torch.float32 and torch.equal(exported[k], weights[k])
        for k in exported
    )
    # bf16 masters, in fp32
    assert all(torch.equal(v, v.bfloat16().float()) for v in exported.values())
    with pytest.raises(CheckpointError, match="optimizer_state as int8 .* configured for fp32"):
        with _engine(_config(tmp_path / "fp32", moments="fp32", master="bf16")) as engine:
            engine.load_checkpoint(tmp_path / "run")
    _refuses_int8_blocks_of_another_size(tmp_path)
    flip_byte(
        tmp_path / "run" / "checkpoints" / "step-00000002", "exp_avg_sq/u0001/r0/p0000", offset=9
    )
    damaged = inspect_run(tmp_path / "run", verify=True).checkpoints[0]
    assert damaged.status == "damaged" and "crc32c" in damaged.reason


def _refuses_int8_blocks_of_another_size(tmp_path: Path) -> None:
    """A checkpoint that records no block or codes (written before blocks of 256 and 8-bit
    floats) has 8-bit Adam's 2048 and its dynamic map: read with this tierzero's every code would
    stand for another value, so it is refused, as one with the block but not the codes is."""
    for drop, written in (("int8_block", "dynamic quantisation in blocks of 2048"), ("", "")):
        older = tmp_path / f"older{drop}"
        shutil.copytree(tmp_path / "run", older)
        checkpoint = older / "checkpoints" / "step-00000002"
        manifest = Manifest.load(checkpoint)
        assert manifest.engine.pop("int8_codes") == INT8_CODES
        if drop:
            assert manifest.engine.pop(drop) == STATE_BLOCK == 256
        (checkpoint / MANIFEST_NAME).write_bytes(manifest.to_json())
        with pytest.raises(
            CheckpointError,
            match=f"int8 moments as blockwise int8 {written}.* reads {INT8_CODES} in blocks of "
            "256; resume it",
        ):
            with _engine(_config(tmp_path / f"older{drop}-nvme")) as engine:
                engine.load_checkpoint(older)


def test_compact_state_moves_fewer_nvme_bytes_and_fp32_stays_torchs_adamw(tmp_path: Path) -> None:
    """fp32 state is the default and stays `torch.optim.AdamW` (the exact tests hold it bitwise);
    int8 moments and a bf16 master read and write 2 + 1 + 1 bytes of state per parameter, not 12."""
    assert StateFormats.of(Config().formats).exact
    moved = {}
    for moments, master in (("fp32", "fp32"), ("int8", "bf16")):
        data = batches()
        with _engine(_config(tmp_path / moments, moments=moments, master=master)) as engine:
            engine.train_step(data.next_batch())
            engine.stats()
            engine.train_step(data.next_batch())
            stats = engine.stats()
            moved[moments] = stats["bytes_nvme->host"] + stats["bytes_host->nvme"]
            n = sum(u.state_numel(0) for u in engine.units)
    assert moved["fp32"] - moved["int8"] == pytest.approx(2 * (12 - 4) * n, rel=0.01)


@pytest.mark.parametrize(
    "placement,dtype",
    [(NVME, "fp32"), (HOST, "fp32"), (NVME, "bf16")],
    ids=["nvme", "host", "nvme-master-is-param"],
)
def test_exact_clipping_beside_backward_re_steps_compact_pieces_bitwise(
    tmp_path: Path, placement: Placement, dtype: str
) -> None:
    """overlap_step keeps the compact generation each piece was stepped from and re-steps it
    once the clip fires (a master that is the param: from the param's held generation on the
    drive): bitwise the step taken after the norm is known."""
    weights = []
    for overlap in (False, True):
        # SMALL's grad norms are above 0.5: the clip fires
        cfg = _config(
            tmp_path / f"overlap{overlap}",
            placement,
            host_budget="256MiB",
            gpu_budget="256MiB",
            clip_grad_norm=0.5,
            overlap_step=overlap,
            dtype=dtype,
        )
        data = batches()
        with _engine(cfg) as engine:
            for _ in range(2):
                engine.train_step(data.next_batch())
            weights.append((engine.master_state_dict(), _moments(engine)))
    assert_same(weights[1][0], weights[0][0])
    assert all(torch.equal(a, b) for a, b in zip(weights[1][1], weights[0][1]))
