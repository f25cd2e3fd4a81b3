"""The engine's counters as one record (`StepState`) that checkpoints write and read; one
backward's facts as an object (`BackwardPass`), not callbacks patched on; an engine that
writes nothing until it opens."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.engine import SMALL, batches
from tierzero import Config, Placement, Tier, models
from tierzero.checkpoint.manifest import Manifest
from tierzero.engine import Engine
from tierzero.engine.step.backward import BackwardPass, StepInBackward
from tierzero.engine.step.state import StepState


def test_step_state_round_trips_and_a_resume_starts_between_steps() -> None:
    state = StepState(
        step_count=7,
        micro=15,
        skipped_steps=2,
        last_grad_norm=0.25,
        previous_norm=torch.tensor(1 / 3, dtype=torch.float32),
        stepped_in_backward=True,
    )
    loaded = StepState()
    loaded.load(state.to_dict())
    assert (loaded.step_count, loaded.skipped_steps, loaded.last_grad_norm) == (7, 2, 0.25)
    assert torch.equal(loaded.previous_norm, state.previous_norm)  # a float32 survives JSON exactly
    assert loaded.micro == 0 and not loaded.stepped_in_backward
    assert state.ends_step(4) and not state.between_steps(4) and StepState(micro=8).between_steps(4)


def test_a_checkpoint_holds_the_engines_step_state(tmp_path: Path) -> None:
    cfg = Config(
        placement=Placement(Tier.GPU, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST),
        clip_grad_norm=0.5,
        clip_previous_norm=True,
        host_budget="256MiB",
        gpu_budget="256MiB",
    )
    data = batches()
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        for _ in range(2):
            engine.train_step(data.next_batch())
        path = engine.save_checkpoint(tmp_path / "run")
        saved = engine.parts.counters.state.to_dict()
    assert saved["step_count"] == 2 and saved["previous_norm"] is not None
    engine = Engine(models.build(SMALL, device="meta"), cfg)
    try:
        engine.load_checkpoint(path)
        loaded = Manifest.load(path).engine
        assert engine.parts.counters.state.to_dict() == saved == {k: loaded[k] for k in saved}
    finally:
        engine.close()


def test_an_engine_writes_nothing_before_open(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    engine = Engine(
        models.build(SMALL, device="meta"), Config(offload="nvme", nvme_path=[str(nvme)])
    )
    assert not nvme.exists()
    with engine:
        assert nvme.is_dir()


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def prefetch(self, unit) -> None:
        self.calls.append(("prefetch", unit.index))

    def step_unit(self, unit, grad, runs, lr, coef) -> None:
        self.calls.append(("step", unit.index, runs, lr, coef))


def test_a_backward_pass_steps_units_only_when_it_carries_a_step() -> None:
    units = Engine(models.build(SMALL, device="meta"), Config()).units
    plain = BackwardPass(micro=1, last=False, inv_scale=0.5)
    plain.unit_starting(2)  # nothing to read ahead: no step in this pass
    optimizer = _Recorder()
    step = StepInBackward(
        optimizer, units, lr=0.1, coef=0.5, runs=lambda u: [(0, 1, True, u.index)]
    )
    BackwardPass(step=step).unit_starting(2)
    BackwardPass(step=step).unit_starting(0)
    step.grad_ready(units[1], torch.zeros(1))
    assert optimizer.calls == [
        ("prefetch", 2),
        ("prefetch", 1),
        ("prefetch", 0),
        ("step", 1, [(0, 1, True, 1)], 0.1, 0.5),
    ]


def test_states_are_enums_spelled_as_before() -> None:
    """Plans, shard records and byte counters use enums whose values are the old strings, so
    printed plans and metrics.jsonl keys (`bytes_nvme->host`) do not change."""
    from tierzero.engine.runtime.swaprunner import ShardStatus
    from tierzero.engine.runtime.transfers import TransferStats
    from tierzero.planning.placement import Link
    from tierzero.planning.swapplan import Op, Phase, build_swap_plan

    plan = build_swap_plan([(0,), (1,)], prefetch_depth=1, backward=True)
    assert {op.phase for op in plan.ops} == {Phase.FORWARD, Phase.BACKWARD}
    assert str(plan.ops[0]) == f"{Op.FETCH.value:8s} u0 (forward)"
    assert [s.value for s in ShardStatus] == ["not_available", "in_flight", "available"]
    stats = TransferStats()
    stats.add_bytes(Link.NVME_TO_HOST, 3)
    stats.add_cache_hit(2)
    busy = {
        f"busy_s/{link}": 0.0
        for link in ("nvme->host", "host->nvme", "host->gpu", "gpu->host", "optimizer")
    }
    assert stats.take() == {
        "bytes_host_cache_hit": 2,
        "bytes_nvme->host": 3,
        "io_wait_s": 0.0,
        "wait_optimizer_s": 0.0,
        **busy,
    }
