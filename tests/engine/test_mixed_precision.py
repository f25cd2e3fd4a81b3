"""Mixed precision, accumulation, clipping and the overlapped step, against plain PyTorch.

Compared: `tierzero.Engine` vs `ReferenceTrainer` (`torch.nn.utils.clip_grad_norm_` +
`torch.optim.AdamW`); accumulation vs one large batch; overlap_step on vs off.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.support.engine import SMALL, batches, engine_config, reference_run
from tierzero import Config, Placement, StateKind, Tier, models
from tierzero.engine import Engine
from tierzero.errors import ConfigError

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
HOST = Placement(Tier.GPU, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)


config = partial(engine_config, piece_numel=8192, total_steps=6)  # this file's values


def engine_run(
    cfg: Config, micro_steps: int, **batch_kw: int
) -> tuple[list[float], dict[str, torch.Tensor], Engine]:
    data = batches(**batch_kw)
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        losses = [engine.train_step(data.next_batch()) for _ in range(micro_steps)]
        return losses, engine.master_state_dict(), engine


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# -- accumulation -----------------------------------------------------------------------------


@pytest.mark.parametrize("placement", [NVME, HOST], ids=["nvme", "host"])
def test_accumulation_bitwise_equal_to_reference_accumulation(tmp_path, placement) -> None:
    cfg = config(tmp_path, placement, accumulate=3)
    ref_losses, ref_weights = reference_run(SMALL, cfg, steps=2)
    losses, weights, engine = engine_run(cfg, 6)
    assert engine.step_count == 2 and losses == ref_losses
    assert_bitwise(weights, ref_weights)


def test_accumulating_k_micro_batches_equals_one_k_times_larger_batch(tmp_path) -> None:
    """fp32: four micro-batches of 2 == one batch of 8, up to summation order. Stated tolerance
    after two AdamW steps at lr 3e-3: 1e-4 absolute (a few % of one step's update; Adam
    normalises, so elements with near-zero grads amplify rounding in relative terms)."""
    micro = config(tmp_path / "a", accumulate=4)
    _, acc_weights, _ = engine_run(micro, 8, batch_size=2)
    big = config(tmp_path / "b", accumulate=1)
    data = batches(batch_size=2)
    with Engine(models.build(SMALL, device="meta", seed=big.seed), big) as engine:
        for _ in range(2):
            parts = [data.next_batch() for _ in range(4)]
            engine.train_step((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
        big_weights = engine.master_state_dict()
    for key in big_weights:
        torch.testing.assert_close(acc_weights[key], big_weights[key], rtol=0, atol=1e-4)


# -- clipping ---------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulate", [1, 2])
def test_clipping_matches_clip_grad_norm_and_adamw(tmp_path, accumulate: int) -> None:
    cfg = config(tmp_path, clip_grad_norm=0.5, accumulate=accumulate)
    ref_losses, ref_weights = reference_run(SMALL, cfg, steps=3)
    losses, weights, engine = engine_run(cfg, 3 * accumulate)
    assert engine.last_grad_norm is not None and engine.last_grad_norm > 0.5  # clipping was active
    assert losses == ref_losses
    assert_bitwise(weights, ref_weights)  # per-parameter norms in model order: exact on one rank


# -- overlap_step -----------------------------------------------------------------------------


@pytest.mark.parametrize("placement", [NVME, HOST, Placement()], ids=["nvme", "host", "gpu"])
def test_overlap_step_is_bitwise_equal_to_the_separate_step(tmp_path, placement) -> None:
    off = engine_run(config(tmp_path / "off", placement, accumulate=2, overlap_step=False), 6)
    on = engine_run(config(tmp_path / "on", placement, accumulate=2, overlap_step=True), 6)
    assert on[0] == off[0]
    assert_bitwise(on[1], off[1])
    if placement == NVME:  # the final grads go straight to the optimizer, not through the drive
        assert on[2].stats()["bytes_host->nvme"] < off[2].stats()["bytes_host->nvme"]


def test_overlap_step_refuses_what_it_cannot_do_exactly(tmp_path) -> None:
    with pytest.raises(ConfigError, match="overlap_step cannot be exact"):
        Engine(
            models.build(SMALL, device="meta"), config(tmp_path, overlap_step=True, dtype="fp16")
        )


def test_overlap_step_is_on_by_default_only_where_exact(tmp_path) -> None:
    assert Engine(models.build(SMALL, device="meta"), config(tmp_path)).parts.overlap
    assert not Engine(
        models.build(SMALL, device="meta"), config(tmp_path, clip_grad_norm=1.0)
    ).parts.overlap
    assert not Engine(
        models.build(SMALL, device="meta"), config(tmp_path, dtype="fp16")
    ).parts.overlap


# -- fp16 dynamic loss scaling ----------------------------------------------------------------


def stored_bytes(engine: Engine) -> dict[str, bytes]:
    """Every shard of every state kind, as raw bytes, read back from its home tier."""
    return {
        f"{kind.value}/{unit.index}": engine.read_shard(kind, unit)
        .view(torch.uint8)
        .numpy()
        .tobytes()
        for unit in engine.units
        for kind in StateKind
        if kind is not StateKind.GRAD
    }


def test_fp16_overflow_skips_the_step_halves_the_scale_and_writes_nothing(tmp_path) -> None:
    cfg = config(tmp_path, dtype="fp16", lr=1e-3)
    data = batches()
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        engine.train_step(data.next_batch())
        scale, steps = engine.parts.counters.scaler.scale, engine.step_count
        before = stored_bytes(engine)
        loss = engine.forward(data.next_batch())
        engine.backward(loss * float("inf"))  # an injected overflow in every gradient
        assert engine.step() is False
        assert engine.parts.counters.scaler.scale == scale / 2 and engine.step_count == steps
        assert stored_bytes(engine) == before
        assert engine.stats()["skipped_steps"] == 1
        losses = [engine.train_step(data.next_batch()) for _ in range(4)]
        assert engine.step_count == steps + 4 and all(torch.isfinite(torch.tensor(losses)))
        assert stored_bytes(engine) != before


def test_fp16_scale_grows_after_a_run_of_good_steps(tmp_path) -> None:
    cfg = config(tmp_path, dtype="fp16", loss_scale=1024, loss_scale_window=2)
    data = batches()
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        for _ in range(4):
            engine.train_step(data.next_batch())
        assert engine.parts.counters.scaler.scale == 4096


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_unsupported_compute_dtype_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, dtype
) -> None:
    import tierzero.precision as precision

    monkeypatch.setattr(precision, "supports", lambda d, device: False)
    with pytest.raises(ConfigError, match=f"dtype {dtype} is not supported .* use --dtype fp32"):
        Engine(models.build(SMALL, device="meta"), config(tmp_path, dtype=dtype))
    assert not (tmp_path / "nvme").exists()


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"loss_scale": 1000.0}, "loss_scale must be a power of two"),
        ({"accumulate": 0}, "accumulate must be an integer >= 1"),
    ],
)
def test_bad_precision_settings(tmp_path, kw, message) -> None:
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, **kw)
    assert not (tmp_path / "nvme").exists()


# -- bf16 tracks the fp32 reference -----------------------------------------------------------

BF16_WINDOW_TOLERANCE = 0.1  # nats: |mean engine loss - mean reference loss| over each 20 steps


def test_bf16_engine_tracks_the_fp32_reference_loss_curve() -> None:
    """100 steps: the engine in bf16 (fp32 master and moments, bf16 grads) against the reference
    trainer in fp32. The model is the tiny preset's shape scaled down (this CPU's bf16 matmuls
    are slow); `benchmarks/bench_bf16_tracking.py` runs the same comparison on `tiny` itself."""
    import numpy as np

    from tierzero.reference import ReferenceTrainer

    common = dict(lr=3e-3, total_steps=100, warmup_steps=10)
    data = batches(8, 32)
    with Engine(
        models.build(SMALL, device="meta"), Config(offload="host", dtype="bf16", **common)
    ) as engine:
        ours = np.array([engine.train_step(data.next_batch()) for _ in range(100)])
    reference = ReferenceTrainer(
        models.build(SMALL), Config(offload="none", dtype="fp32", **common)
    )
    data = batches(8, 32)
    theirs = np.array([reference.train_step(data.next_batch()) for _ in range(100)])
    ours_w, theirs_w = ours.reshape(5, 20).mean(1), theirs.reshape(5, 20).mean(1)
    assert np.abs(ours_w - theirs_w).max() < BF16_WINDOW_TOLERANCE, (ours_w, theirs_w)
    assert ours_w[-1] < ours_w[0] - 1.0  # and it learns


def test_clipping_by_the_previous_norm_is_an_opt_in_approximation(tmp_path) -> None:
    """With clip_previous_norm, overlap_step clips step k by step k-1's global norm: step 1 is
    unclipped (bitwise the unclipped reference), and the norm it logs is the reference's."""
    from tierzero.reference import ReferenceTrainer

    cfg = config(tmp_path, clip_grad_norm=0.5, clip_previous_norm=True)
    engine = Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg)
    assert engine.parts.overlap
    _, unclipped = reference_run(SMALL, config(tmp_path), steps=1)
    reference = ReferenceTrainer(
        models.build(SMALL, seed=cfg.seed), config(tmp_path, clip_grad_norm=0.5)
    )
    data, ref_data = batches(), batches()
    with engine:
        engine.train_step(data.next_batch())
        reference.train_step(ref_data.next_batch())
        assert_bitwise(engine.master_state_dict(), unclipped)
        assert engine.last_grad_norm == reference.last_grad_norm > 0.5
        losses = [engine.train_step(data.next_batch()) for _ in range(4)]
    assert losses[-1] < losses[0]


def test_forward_after_an_overlapped_backward_settles_the_step(tmp_path) -> None:
    """overlap_step updates shards during backward; a forward without step() must not read
    them half-written, so it finishes the step first (same weights as calling step())."""
    explicit = engine_run(config(tmp_path / "a"), 3)[1]
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=0), config(tmp_path / "b")) as engine:
        for _ in range(3):
            engine.backward(engine.forward(data.next_batch()))  # no step() calls
        engine.forward(data.next_batch())
        assert engine.step_count == 3
        assert_bitwise(engine.master_state_dict(), explicit)
