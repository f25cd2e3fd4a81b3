"""Faults and edge cases: failed transfers, interrupts, exact budgets, closing, model shapes.

Each test injects one fault or edge and asserts the engine either stays exact or stops with
a clear error, without writing anything it should not.
"""

from __future__ import annotations

import concurrent.futures
from functools import partial

import pytest
import torch
from torch import nn

from tests.support.engine import SMALL, batches, engine_config, reference_run
from tierzero import Placement, StateKind, Tier, models
from tierzero.engine import Engine
from tierzero.engine.runtime.tiers import Pending
from tierzero.errors import TierzeroError
from tierzero.planning.ledger import activation_memory

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)


# this file's values: no budgets (the engine chooses)
config = partial(engine_config, total_steps=6, host_budget=None, gpu_budget=None)

# -- the pending queue ------------------------------------------------------------------------


class _Interrupted(concurrent.futures.Future):
    """A transfer still running when the wait for it is interrupted (Ctrl-C)."""

    def result(self, timeout=None):
        if not self.done():
            raise KeyboardInterrupt
        return super().result(timeout)


def test_interrupted_wait_keeps_the_transfer_queued() -> None:
    pending, done = Pending(), []
    future = _Interrupted()
    pending.add(future, done.append)
    with pytest.raises(KeyboardInterrupt):
        pending.drain()
    assert done == [] and len(pending) == 1  # its buffer is still the I/O thread's
    future.set_result(None)
    pending.drain()
    assert done == [True] and len(pending) == 0


def test_failed_transfer_reports_not_ok_and_raises() -> None:
    pending, done = Pending(), []
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(OSError("EIO"))
    pending.add(future, done.append)
    with pytest.raises(OSError):
        pending.drain()
    assert done == [False]


# -- failed reads never become writes ---------------------------------------------------------


def test_failed_optimizer_read_writes_nothing_and_stops_the_engine(tmp_path, monkeypatch) -> None:
    data = batches()
    with Engine(models.build(SMALL, device="meta"), config(tmp_path, overlap_step=True)) as engine:
        engine.train_step(data.next_batch())
        store = engine.parts.tiers.stores[Tier.NVME]
        unit = engine.units[2]
        before = engine.read_shard(StateKind.EXP_AVG, unit).clone()
        real = store.read_into

        async def failing(key, out, verify=False):
            if key.startswith("exp_avg/u0002/r0/"):  # its one piece
                raise OSError(5, "injected EIO")
            await real(key, out, verify)

        monkeypatch.setattr(store, "read_into", failing)
        with pytest.raises(OSError, match="injected"):
            engine.train_step(data.next_batch())
        monkeypatch.setattr(store, "read_into", real)
        assert torch.equal(engine.read_shard(StateKind.EXP_AVG, unit), before)
        with pytest.raises(TierzeroError, match="stopped in the middle of a step"):
            engine.train_step(data.next_batch())


# -- budgets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0, 2, 4])
@pytest.mark.parametrize("overlap", [False, True])
def test_budgets_at_the_stated_minimum_train_exactly(tmp_path, depth: int, overlap: bool) -> None:
    """Budgets of exactly what the memory model says (RAM in all on the CPU device, the
    batch's activations included): the step fits, stays exact, and every pool stays in budget."""
    model = models.build(SMALL, device="meta")
    probe = Engine(model, config(tmp_path, prefetch_depth=depth, overlap_step=overlap))
    need = probe.parts.sizing.memory(
        NVME, probe.parts.layout.stage, activation_memory(SMALL, 4, 32, 4, model.loss_chunk_bytes)
    )
    cfg = config(
        tmp_path, prefetch_depth=depth, overlap_step=overlap, host_budget=need.host_total_bytes
    )
    _, ref_weights = reference_run(SMALL, cfg, steps=3)
    data = batches()
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        for _ in range(3):
            engine.train_step(data.next_batch())
        weights = engine.master_state_dict()
        tiers = engine.parts.tiers
        peaks = tiers.peaks()
        budgets = tiers.host_pool.budget_bytes, tiers.device_pool.budget_bytes
    assert peaks["host"] <= budgets[0] and peaks["gpu"] <= budgets[1]
    assert sum(budgets) <= need.host_total_bytes
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key


# -- lifecycle --------------------------------------------------------------------------------


def test_close_is_idempotent_and_final(tmp_path) -> None:
    engine = Engine(models.build(SMALL, device="meta"), config(tmp_path))
    engine.train_step(batches().next_batch())
    engine.close()
    engine.close()
    with pytest.raises(TierzeroError, match="engine is closed"):
        engine.master_state_dict()


# -- model shapes -----------------------------------------------------------------------------


class _DropoutNet(nn.Module):
    """Blocks with dropout and a registered buffer; no parameters before the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3)) for _ in range(3)
        )
        self.head = nn.Linear(8, 1)
        self.register_buffer("offset", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x + self.offset
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x).squeeze(-1), y)


def test_dropout_buffers_and_grad_free_inputs_match_plain_pytorch(tmp_path) -> None:
    from tierzero.reference import ReferenceTrainer

    torch.manual_seed(0)
    template = _DropoutNet()
    xs, ys = torch.randn(4, 16, 8), torch.randn(4, 16)
    cfg = config(tmp_path)
    ref_model = _DropoutNet()
    ref_model.load_state_dict(template.state_dict())
    ref = ReferenceTrainer(ref_model, cfg)
    torch.manual_seed(1)
    ref_losses = [ref.train_step((x, y)) for x, y in zip(xs, ys)]
    ref_eval = ref.eval_loss((xs[0], ys[0]))
    model = _DropoutNet()
    model.load_state_dict(template.state_dict())
    with Engine(model, cfg) as engine:
        torch.manual_seed(1)
        losses = [engine.train_step((x, y)) for x, y in zip(xs, ys)]
        assert engine.eval_loss((xs[0], ys[0])) == ref_eval  # dropout off in eval
        weights = engine.master_state_dict()
    assert losses == ref_losses
    for key, value in ref.master_state_dict().items():
        assert torch.equal(weights[key], value), key
