"""Grads in the dtype the planner chooses (`tierzero.planning.statebytes.grad_dtype`).

Compared: the grad home's stored dtype per (compute dtype, accumulate, schedule); bf16 grads
against fp32 grads (the sizing's choice patched) where nothing is summed (bitwise) and in the
bytes a step moves; the clip's norm against the grads stored; a bf16 vertical run against the
fp32 reference at the bf16 tests' tolerance.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest
import torch

from tests.engine.test_mixed_precision import BF16_WINDOW_TOLERANCE
from tests.support.engine import NVME, SMALL, batches, engine_config
from tierzero import Config, Placement, StateKind, Tier, models
from tierzero.checkpoint.inspect import store_info
from tierzero.config import DType
from tierzero.engine import Engine, sizing
from tierzero.layout.keys import state_keys
from tierzero.reference import ReferenceTrainer

HOST = Placement(Tier.GPU, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)
UNTIED = dataclasses.replace(SMALL, tie_embeddings=False)

config = partial(engine_config, piece_numel=8192, total_steps=6)


def host_home_dtypes(engine: Engine) -> set[torch.dtype]:
    """The dtypes of every grad key in a host grad home."""
    store = engine.parts.tiers.stores[Tier.HOST]
    return {
        store.view(key).dtype
        for unit in engine.units
        for key, _, _ in state_keys(
            StateKind.GRAD, unit, 0, engine.config.streaming.piece_numel, Tier.HOST
        )
    }


def fp32_grads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the engine's sizing choose fp32 grads whatever the run: the baseline."""
    monkeypatch.setattr(sizing, "grad_dtype", lambda compute, accumulate, schedule: DType.FP32)


@pytest.mark.parametrize(
    "dtype, accumulate, schedule, expected",
    [
        ("bf16", 1, "auto", torch.bfloat16),  # one micro-batch per step: stored once
        ("bf16", 2, "vertical", torch.bfloat16),  # summed on the device, stored once
        (
            "bf16",
            2,
            "horizontal",
            torch.float32,
        ),  # each micro-batch added into the home
        (
            "bf16",
            2,
            "auto",
            torch.float32,
        ),  # decided at the first step: may be horizontal
        ("fp32", 1, "auto", torch.float32),
        ("fp16", 1, "auto", torch.float32),  # stored unscaled: fp16 would underflow
    ],
)
def test_the_grad_home_holds_the_planned_dtype(
    tmp_path, dtype: str, accumulate: int, schedule: str, expected: torch.dtype
) -> None:
    cfg = config(
        tmp_path,
        HOST,
        dtype=dtype,
        accumulate=accumulate,
        schedule=schedule,
        overlap_step=False,
    )
    data = batches()
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        engine.open()
        assert host_home_dtypes(engine) == {expected}
        for _ in range(2 * accumulate):
            engine.train_micro_batch(data.next_batch())
        assert engine.step_count == 2
        assert host_home_dtypes(engine) == {expected}  # written by the steps in it


def test_bf16_grads_of_one_unsummed_micro_batch_are_bitwise_the_fp32_grads(
    tmp_path, monkeypatch
) -> None:
    """One rank, one micro-batch, no tied weight: every grad is a bf16 weight's grad, so rounding
    the fp32 shard to bf16 is exact and the run is bitwise the fp32-grad run."""

    def run(root) -> dict[str, torch.Tensor]:
        data = batches()
        with Engine(
            models.build(UNTIED, device="meta"),
            config(root, dtype="bf16", clip_grad_norm=1.0),
        ) as engine:
            for _ in range(3):
                engine.train_step(data.next_batch())
            assert engine.last_grad_norm is not None
            return engine.master_state_dict()

    bf16 = run(tmp_path / "bf16")
    fp32_grads(monkeypatch)
    fp32 = run(tmp_path / "fp32")
    for key in fp32:
        assert torch.equal(bf16[key], fp32[key]), key


def test_bf16_grads_halve_the_grad_bytes_a_step_moves(tmp_path, monkeypatch) -> None:
    """Everything on NVMe, one micro-batch, clipping (the step waits for the norm, so grads go
    through their home): 2 bytes fewer per trained parameter written and as many fewer read,
    and the store holds 2 bytes per grad."""

    def run(root) -> tuple[dict[str, float], int]:
        data = batches()
        cfg = config(root, dtype="bf16", clip_grad_norm=1.0)
        with Engine(models.build(SMALL, device="meta"), cfg) as engine:
            engine.train_step(data.next_batch())
            engine.stats()
            engine.train_step(data.next_batch())
            trained = sum(u.state_numel(0) for u in engine.units)
            return engine.stats(), trained

    (bf16, trained), grads = (
        run(tmp_path / "bf16"),
        store_info(tmp_path / "bf16" / "nvme").kinds["grad"],
    )
    assert grads.nbytes == 2 * trained
    fp32_grads(monkeypatch)
    fp32, _ = run(tmp_path / "fp32")
    assert fp32["bytes_host->nvme"] - bf16["bytes_host->nvme"] == 2 * trained
    assert fp32["bytes_nvme->host"] - bf16["bytes_nvme->host"] == 2 * trained
    assert fp32["bytes_gpu->host"] - bf16["bytes_gpu->host"] == 2 * trained


@pytest.mark.parametrize("placement", [NVME, HOST], ids=["nvme", "host"])
def test_the_clip_measures_the_grads_the_optimizer_steps(tmp_path, placement: Placement) -> None:
    """bf16 grads with clipping: the stored grads are bf16 values, and the norm the step clipped
    by is theirs, combined per parameter in model order as `clip_grad_norm_` combines it."""
    data = batches()
    with Engine(
        models.build(SMALL, device="meta"),
        config(tmp_path, placement, dtype="bf16", clip_grad_norm=0.5),
    ) as engine:
        for _ in range(2):
            engine.train_step(data.next_batch())
        norms = {}
        for unit in engine.units:
            grad = engine.read_shard(StateKind.GRAD, unit)
            assert torch.equal(grad, grad.bfloat16().float()), unit.name
            for slot in unit.slots:
                norms[slot.names[0]] = torch.linalg.vector_norm(grad[slot.offset : slot.end], 2.0)
        order = engine.parts.param_order  # the model's parameter names, in its order
        total = torch.linalg.vector_norm(torch.stack([norms[n] for n in order if n in norms]), 2.0)
        assert engine.last_grad_norm == total.item() > 0.5


def test_bf16_vertical_run_with_bf16_grads_tracks_the_fp32_reference() -> None:
    """50 steps of 2 micro-batches, the vertical schedule with bf16 grads (everything on host),
    against the reference trainer in fp32 on the same micro-batches: the mean loss of every 10
    steps within the bf16 tests' tolerance, and it learns."""
    common = {"lr": 3e-3, "total_steps": 50, "warmup_steps": 5, "accumulate": 2}
    data = batches(8, 32)
    cfg = Config(offload="host", dtype="bf16", schedule="vertical", **common)
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        assert engine.parts.layout.grad_dtype == torch.bfloat16
        ours = []
        for _ in range(50):
            losses = [engine.train_micro_batch(data.next_batch()) for _ in range(2)]
            ours.append(float(sum(loss.item() for loss in losses)) / 2)
    reference = ReferenceTrainer(
        models.build(SMALL), Config(offload="none", dtype="fp32", **common)
    )
    data = batches(8, 32)
    theirs = [sum(reference.train_step(data.next_batch()) for _ in range(2)) / 2 for _ in range(50)]
    ours_w, theirs_w = (
        np.array(ours).reshape(5, 10).mean(1),
        np.array(theirs).reshape(5, 10).mean(1),
    )
    assert np.abs(ours_w - theirs_w).max() < BF16_WINDOW_TOLERANCE, (ours_w, theirs_w)
    assert ours_w[-1] < ours_w[0] - 1.0


@pytest.mark.parametrize(
    "placement, kw",
    [
        (NVME, {"clip_grad_norm": 0.5}),
        (HOST, {"accumulate": 2, "schedule": "vertical"}),
    ],
    ids=["nvme-clipped", "host-vertical"],
)
def test_a_resumed_bf16_grad_run_is_bitwise_the_uninterrupted_one(
    tmp_path, placement: Placement, kw: dict
) -> None:
    """Checkpoints hold no grads (a step's grads are written before they are read), so a
    resume with bf16 grad homes continues bitwise: 3 steps, a checkpoint, 2 steps the crash
    loses, then a resume and 3 steps against 6 uninterrupted ones."""
    micro = kw.get("accumulate", 1)

    def steps(engine: Engine, data, n: int) -> None:
        for _ in range(n * micro):
            engine.train_micro_batch(data.next_batch())

    cfg = config(tmp_path / "a", placement, dtype="bf16", **kw)
    data = batches()
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        assert engine.parts.layout.grad_dtype == torch.bfloat16
        steps(engine, data, 6)
        reference = engine.master_state_dict()
    cfg = config(tmp_path / "b", placement, dtype="bf16", **kw)
    data = batches()
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        steps(engine, data, 3)
        engine.save_checkpoint(tmp_path / "run", data=data.state_dict())
        steps(engine, data, 2)
    data = batches()
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        data.load_state_dict(engine.load_checkpoint(tmp_path / "run").data)
        steps(engine, data, 3)
        resumed = engine.master_state_dict()
    for key in reference:
        assert torch.equal(resumed[key], reference[key]), key
