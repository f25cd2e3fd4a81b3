"""The plan of an NF4 base (`--quantize-base nf4`): counted as the engine stores it, and checked
against what a training run measures.

A small saved LLaMA (hidden 128, MLP 320, 2 layers) under LoRA (r = 8 on q_proj, v_proj), fp32:
`CodedBase` counts every param piece the engine's `CodedShard` lays out, at several piece
sizes and dtypes; a run with every state on NVMe holds on the drive exactly the param bytes the
plan homes there, its compute pool peaks at the plan's figure (decoded units: the same as the
bf16 base's), and what it copies up per step shrinks by the plan's ratio. `tierzero plan
--quantize-base nf4` says what is quantised and refuses, in one sentence, what cannot be.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from tierzero.cli.app import app
from typer.testing import CliRunner

from tests.hf.test_hf_qlora import NVME, batches, config, lora_model
from tests.support.cli import one_line_error
from tests.support.hf import save_coded_base
from tierzero.config import Tier
from tierzero.engine import Engine
from tierzero.hf.lora import LoraSpec
from tierzero.hf.plan import hf_workload
from tierzero.models.nf4_shard import CodedShard
from tierzero.planning.codedbase import CodedBase
from tierzero.planning.placement import Link, estimate
from tierzero.planning.workload import Workload

runner = CliRunner()
PIECE = 8192  # the run's piece size: a block's frozen rest is several coded pieces


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return save_coded_base(tmp_path_factory.mktemp("coded") / "base")


def lora_units(base_dir: Path) -> list:
    """The model's units under LoRA as the plan builds them: on meta, from config.json."""
    spec = LoraSpec(8, 16.0, 0.0, ("q_proj", "v_proj"))
    return hf_workload(f"hf:{base_dir}", 1, spec)["units"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("piece", [2048, PIECE, 1 << 24])
def test_the_plan_counts_the_pieces_the_engine_stores(base_dir, dtype, piece) -> None:
    units = lora_units(base_dir)
    coded = CodedBase.of(units)
    blocks = [u for u in units if u.kind == "block"]
    assert [u.index for u in units if coded.is_coded(u)] == [u.index for u in blocks]
    for unit in blocks:
        shard = CodedShard(unit, 0, piece, dtype)
        stored = Counter((p.end - p.at) * dtype.itemsize for p in shard.pieces)
        assert coded.piece_counts(unit, piece, dtype.itemsize) == stored
        assert coded.shard_nbytes(unit, piece, dtype.itemsize) == shard.stored_nbytes
    # q, k, v, o, gate, up, down of two blocks; the adapters, norms, embedding and head are not
    linear = 2 * (4 * 128 * 128 // 2 + 2 * 128 * 128 // 2 + 3 * 128 * 320)  # 4 heads, 2 kv
    assert coded.quantized_numel == linear


def test_planned_bytes_are_what_a_run_stores_and_moves(base_dir, tmp_path) -> None:
    """Every state on NVMe, fp32, the step after overlap off (what `estimate` counts): the
    drive holds each unit's param as the plan sizes it; the compute pool peaks at the plan's
    figure; the param bytes fetched per step (each a read or a cache hit) are the plan's, and
    what is copied up shrinks by the plan's ratio."""
    measured, planned = {}, {}
    for base in ("nf4", "none"):
        settings = config(tmp_path / base, quantize_base=base, overlap_step=False)
        with Engine(lora_model(base_dir), settings) as eng:
            param_dir = tmp_path / base / "nvme" / "param"
            on_drive = [_allocated(d) for d in sorted(param_dir.glob("u*"))]  # before a step
            data = batches()
            eng.train_step(data.next_batch())
            eng.stats()
            eng.train_step(data.next_batch())
            measured[base] = eng.stats()
            coded = CodedBase.of(eng.units) if base == "nf4" else None
            work = Workload.from_units(
                eng.units, 4, device="cpu", piece_numel=PIECE, overlap=False, coded=coded
            )
        planned[base] = estimate(NVME, work)
        assert on_drive == work.stored_param_nbytes(), base
        gpu_pool = planned[base].memory.tiers[Tier.GPU].pool_bytes
        assert 0.9 * gpu_pool <= measured[base]["peak_gpu_bytes"] <= gpu_pool, base
        fetched = measured[base]["bytes_nvme->host"] + measured[base]["bytes_host_cache_hit"]
        # within 2%: the plan counts each unit's params twice and unpadded; the swap plan fetches
        # the tied embedding with the head, and holds the units at the turn of the pass
        assert fetched == pytest.approx(planned[base].moved_bytes[Link.NVME_TO_HOST], rel=0.02)
    # the decoded units take the same room on the compute device
    assert measured["nf4"]["peak_gpu_bytes"] == measured["none"]["peak_gpu_bytes"]
    up = {b: measured[b]["bytes_host->gpu"] for b in measured}
    planned_up = {b: planned[b].moved_bytes[Link.HOST_TO_GPU] for b in planned}
    assert up["nf4"] / up["none"] == pytest.approx(planned_up["nf4"] / planned_up["none"], rel=0.01)
    assert up["nf4"] < 0.4 * up["none"]  # fp32: 0.5625 of 4 bytes a quantised weight


def _allocated(unit_dir: Path) -> int:
    """Bytes a unit's chunk files take on the drive (they are sparse past their data)."""
    return sum(f.stat().st_blocks * 512 for f in unit_dir.rglob("c/*"))


def plan_cli(base_dir: Path, *args: str):
    return runner.invoke(
        app,
        [
            "plan",
            "--model",
            f"hf:{base_dir}",
            "--gpu-mem",
            "64MB",
            "--host-mem",
            "1GB",
            "--nvme-free",
            "10GB",
            "--dtype",
            "bf16",
            *args,
        ],
    )


def test_plan_says_what_is_quantized_and_keeps_the_base_off_the_gpu(base_dir) -> None:
    lora = ("--lora-r", "8", "--lora-targets", "q_proj,v_proj")
    result = plan_cli(base_dir, *lora, "--quantize-base", "nf4")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "Base: nf4: 344.1k params, the blocks' frozen linear weights, in 4 bits" in text
    assert "(0.5625 B each with its block's absmax)" in text
    coded = json.loads(plan_cli(base_dir, *lora, "--quantize-base", "nf4", "--json").stdout)
    plain = json.loads(plan_cli(base_dir, *lora, "--json").stdout)
    assert coded["base"]["quantize_base"] == "nf4" and plain["base"]["quantize_base"] == "none"
    assert coded["base"]["quantized_params"] == 2 * (2 * 128 * 128 + 128 * 64 * 2 + 3 * 128 * 320)
    assert coded["base"]["stored_bytes"] < plain["base"]["stored_bytes"]
    assert plain["base"]["stored_bytes"] == coded["base"]["compute_dtype_bytes"]
    assert all(p["placement"]["param"] != "gpu" for p in coded["placements"])
    assert "Base:" not in plan_cli(base_dir, *lora).output  # nothing to say of a plain base


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--quantize-base", "nf4"], "have none frozen; train adapters (--lora-r)"),
        (["--lora-r", "8", "--quantize-base", "int3"], "--quantize-base 'int3' is not valid"),
        (["--lora-r", "8", "--quantize-base", "nf4", "--gpus", "2"], "trains on one rank"),
    ],
)
def test_plan_refuses_what_an_nf4_base_cannot_be_in_one_sentence(base_dir, args, said) -> None:
    assert said in one_line_error(plan_cli(base_dir, *args))


def test_a_preset_has_no_frozen_base_to_quantize() -> None:
    for args in (["--quantize-base", "nf4"], ["--lora-r", "8"]):
        result = runner.invoke(app, ["plan", "--model", "tiny", "--host-mem", "1GB", *args])
        assert "--model hf:DIR" in one_line_error(result)
