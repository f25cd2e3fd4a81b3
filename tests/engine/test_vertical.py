"""The vertical schedule (`tierzero.engine.vertical.schedule`) against plain PyTorch and the
horizontal one.

fp32, one rank: k micro-batches run unit by unit must leave parameters bitwise equal to
`torch.optim.AdamW` with gradient accumulation (`reference_run`), for every placement, tied
and untied, and with the waiting activations spilled to NVMe by a small budget. What it saves is
counted: per step each unit's params are read from NVMe once per pass whatever k is, and each
grad is written once.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from test_engine_exact import PLACEMENTS, config
from torch import nn

from tests.support.engine import SMALL, assert_same, batches, fresh, reference_run
from tierzero import Config, models
from tierzero.config import Schedule
from tierzero.engine import Engine
from tierzero.errors import ConfigError, TierzeroError
from tierzero.planning.ledger import waiting_activations_bytes
from tierzero.planning.swapplan import Op, Phase, build_swap_plan

K, STEPS = 3, 2
UNTIED = dataclasses.replace(SMALL, tie_embeddings=False)


def train(
    args, cfg: Config, steps: int = STEPS
) -> tuple[list[float], dict[str, torch.Tensor], Engine]:
    """`steps` steps of `cfg.execution.accumulate` micro-batches through
    `Engine.train_micro_batch`."""
    data, losses = batches(), []
    with Engine(models.build(args, device="meta", seed=cfg.seed), cfg) as engine:
        for _ in range(steps):
            micro = [
                engine.train_micro_batch(data.next_batch()) for _ in range(cfg.execution.accumulate)
            ]
            losses += [t.item() for t in micro]  # known once the step's last micro-batch has run
        weights = engine.master_state_dict()
    return losses, weights, engine


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_vertical_is_bitwise_equal_to_pytorch_accumulation(tmp_path, name: str, tied: bool) -> None:
    args = SMALL if tied else UNTIED
    cfg = config(tmp_path, PLACEMENTS[name], accumulate=K, schedule="vertical")
    ref_losses, ref_weights = reference_run(args, cfg, steps=STEPS)
    losses, weights, engine = train(args, cfg)
    assert engine.vertical.on
    assert losses == ref_losses
    assert_same(weights, ref_weights)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_vertical_equals_horizontal_with_activations_spilled(tmp_path, tied: bool) -> None:
    """A budget of two activations: most wait on NVMe and come back before their backward."""
    args = SMALL if tied else UNTIED
    act_bytes = 4 * 32 * args.dim * 4  # batch x seq x dim, fp32
    horizontal = train(
        args, config(fresh(tmp_path, "h"), PLACEMENTS["everything-on-nvme"], accumulate=K)
    )
    cfg = config(
        fresh(tmp_path, "v"),
        PLACEMENTS["everything-on-nvme"],
        accumulate=K,
        schedule="vertical",
        activation_budget=2 * act_bytes,
        recompute="all",  # every block input waits in the store (a kept graph holds its own)
    )
    losses, weights, engine = train(args, cfg)
    store = engine.vertical.store
    assert store.budget_bytes == 2 * act_bytes
    assert store.spilled > STEPS * K  # spilled every step, not once
    assert 0 < store.peak_bytes <= store.budget_bytes
    assert losses == horizontal[0]
    assert_same(weights, horizontal[1])


def test_params_are_read_once_per_pass_whatever_the_accumulation(tmp_path) -> None:
    """Everything on NVMe, a host cache too small to keep params: the bytes read per step are
    the same at k = 1 and k = 3 vertically, and grow with k horizontally."""

    def nvme_bytes(k: int, schedule: str) -> tuple[int, int]:
        cfg = config(
            fresh(tmp_path, f"{schedule}{k}"),
            PLACEMENTS["everything-on-nvme"],
            accumulate=k,
            schedule=schedule,
            prefetch_depth=0,
        )
        data = batches()
        with Engine(models.build(UNTIED, device="meta", seed=0), cfg) as engine:
            for _ in range(k):
                engine.train_micro_batch(data.next_batch())  # the first step: the host cache warms
            engine.stats()
            for _ in range(k):
                engine.train_micro_batch(data.next_batch())
            stats = engine.stats()
        return stats["bytes_nvme->host"] + stats.get("bytes_host_cache_hit", 0), stats[
            "bytes_host->nvme"
        ]

    read1, written1 = nvme_bytes(1, "vertical")
    read3, written3 = nvme_bytes(3, "vertical")
    assert (read3, written3) == (read1, written1)
    horizontal3 = nvme_bytes(3, "horizontal")
    assert horizontal3[0] > read3 and horizontal3[1] > written3


def test_the_swap_plan_carries_micro_batches(tmp_path) -> None:
    """One fetch, wait and release per use; each unit computed once per micro-batch and phase;
    the head has no forward use (its loss is computed in its backward)."""
    cfg = config(tmp_path, PLACEMENTS["everything-on-nvme"], accumulate=K, schedule="vertical")
    with Engine(models.build(UNTIED, device="meta"), cfg) as engine:
        plan, n = engine.opened.vertical_plan, len(engine.units)
    head = n - 1
    for phase in Phase:
        units = range(n - 1) if phase is Phase.FORWARD else range(n)
        computes = [
            (op.unit, op.micro) for op in plan.ops if op.op is Op.COMPUTE and op.phase is phase
        ]
        assert sorted(computes) == sorted((u, m) for u in units for m in range(K))
        waits = [op.unit for op in plan.ops if op.op is Op.WAIT and op.phase is phase]
        assert sorted(waits) == list(units)
    assert not any(op.unit == head and op.phase is Phase.FORWARD for op in plan.ops)
    assert "compute  u1 m2 (forward)" in str(plan)


def test_auto_runs_vertically_only_where_it_helps(tmp_path) -> None:
    def chosen(k: int) -> bool:
        cfg = config(
            fresh(tmp_path, str(k)), PLACEMENTS["everything-on-nvme"], accumulate=k, schedule="auto"
        )
        with Engine(models.build(SMALL, device="meta"), cfg) as engine:
            engine.train_micro_batch(batches().next_batch())
            return engine.vertical.on

    assert chosen(2) and not chosen(1)


class _NotAChain(nn.Module):
    """Blocks the engine can split, but a forward of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.model = models.build(SMALL, seed=0)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(idx, targets)


def test_refusals_are_one_sentence(tmp_path) -> None:
    cfg = config(fresh(tmp_path, "a"), PLACEMENTS["all-gpu"], accumulate=2, schedule="vertical")
    with (
        Engine(_NotAChain(), cfg) as engine,
        pytest.raises(ConfigError, match="needs a chain of units"),
    ):
        engine.train_micro_batch(batches().next_batch())
    with Engine(
        models.build(SMALL, device="meta"),
        config(fresh(tmp_path, "b"), PLACEMENTS["all-gpu"], accumulate=2, schedule="vertical"),
    ) as engine:
        with pytest.raises(ConfigError, match="call train_micro_batch"):
            engine.forward(batches().next_batch())
        with pytest.raises(TierzeroError, match="known once its step's last micro-batch has run"):
            engine.train_step(batches().next_batch())
    with pytest.raises(ConfigError, match="schedule 'sideways' is not valid"):
        Config(schedule="sideways")
    assert Config().execution.schedule is Schedule.AUTO


def with_dropout(seed: int, device: str = "meta") -> nn.Module:
    """The built-in model with dropout 0.1 after every block's MLP."""
    model = models.build(UNTIED, device=device, seed=seed)
    for block in model.blocks:
        block.mlp = nn.Sequential(block.mlp, nn.Dropout(0.1))
    return model


def test_dropout_draws_the_same_masks_in_both_schedules(tmp_path) -> None:
    """Each (micro-batch, unit) call draws from a state seeded by (step, micro-batch, unit),
    so the schedules' orders do not matter: vertical == horizontal == the reference trainer
    (plain PyTorch AdamW, each unit's call seeded alike), bitwise, and dropout does draw."""
    from tierzero.reference import ReferenceTrainer

    def run(schedule: str) -> tuple[list[float], dict[str, torch.Tensor], bool]:
        cfg = config(
            fresh(tmp_path, schedule),
            PLACEMENTS["everything-on-nvme"],
            accumulate=K,
            schedule=schedule,
        )
        data = batches()
        with Engine(with_dropout(cfg.seed), cfg) as engine:
            losses = [engine.train_micro_batch(data.next_batch()) for _ in range(STEPS * K)]
            return [t.item() for t in losses], engine.master_state_dict(), bool(engine.vertical.on)

    h_losses, h_weights, h_on = run("horizontal")
    v_losses, v_weights, v_on = run("vertical")
    assert v_on and not h_on
    assert v_losses == h_losses
    assert_same(v_weights, h_weights)
    cfg = config(fresh(tmp_path, "ref"), PLACEMENTS["everything-on-nvme"], accumulate=K)
    reference, data = ReferenceTrainer(with_dropout(cfg.seed, "cpu"), cfg), batches()
    assert [reference.train_step(data.next_batch()) for _ in range(STEPS * K)] == v_losses
    assert_same(v_weights, reference.master_state_dict())
    _, no_dropout, _ = train(
        UNTIED,
        config(
            fresh(tmp_path, "none"),
            PLACEMENTS["everything-on-nvme"],
            accumulate=K,
            schedule="vertical",
        ),
    )
    assert not torch.equal(no_dropout["head.weight"], v_weights["head.weight"])


def test_each_unit_is_gathered_once_per_pass_for_every_micro_batch() -> None:
    """Several ranks: the vertical plan lists one all-gather per use, however many micro-batches."""
    calls = [(0,), (1,), (2,), (3,), (4, 0)]  # a tied head binds the embedding
    plan = build_swap_plan(calls, 2, backward=True, gather_ahead=1, micro_batches=K)
    gathers = [(op.unit, op.phase) for op in plan.ops if op.op is Op.GATHER]
    assert sorted(gathers) == sorted(
        [(u, Phase.FORWARD) for u in range(4)] + [(u, Phase.BACKWARD) for u in (4, 0, 3, 2, 1, 0)]
    )


def _rank(rank: int, root: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2
    )
    try:
        cfg = Config(
            placement=PLACEMENTS["mixed"],
            nvme_path=[f"{root}/nvme"],
            lr=3e-3,
            total_steps=STEPS,
            accumulate=2,
            schedule="vertical",
        )
        data = batches()
        with Engine(models.build(SMALL, device="meta", seed=0), cfg) as engine:
            for _ in range(STEPS * 2):
                x, y = data.next_batch()
                engine.train_micro_batch((x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
            assert engine.vertical.on
            weights = engine.master_state_dict()  # a collective: every rank gathers
        if rank == 0:
            save_file(
                {k: v.contiguous() for k, v in weights.items() if k != "head.weight"},
                f"{root}/weights.safetensors",
            )
    finally:
        dist.destroy_process_group()


def test_two_ranks_vertically_match_the_full_batch_reference(tmp_path) -> None:
    """Within `test_engine_two_ranks`'s tolerance: each unit's grad is summed over the
    micro-batches on each rank and reduce-scattered once, so the sum's order differs."""
    mp.spawn(_rank, args=(str(tmp_path),), nprocs=2, join=True)
    weights = load_file(str(tmp_path / "weights.safetensors"))
    _, ref = reference_run(
        SMALL, Config(offload="none", lr=3e-3, total_steps=STEPS, accumulate=2), steps=STEPS
    )
    for key, value in weights.items():
        torch.testing.assert_close(value, ref[key], rtol=0, atol=5e-5)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_waiting_activations_peak_at_the_memory_models_count(tmp_path, tied: bool) -> None:
    """Room for all of them: nothing spills, and the store's peak is the predicted bytes (every
    block input of every micro-batch, and a tied embedding's grads from the head)."""
    args = SMALL if tied else UNTIED
    cfg = config(
        tmp_path,
        PLACEMENTS["everything-on-nvme"],
        accumulate=K,
        schedule="vertical",
        recompute="all",  # every block input waits in the store (a kept graph holds its own)
    )
    _, _, engine = train(args, cfg)
    store = engine.vertical.store
    tokens = 4 * 32
    predicted = waiting_activations_bytes(
        args.n_layers, args.dim, args.vocab_size, tied, tokens, K, 4
    )
    assert store.spilled == 0
    assert store.peak_bytes == store.budget_bytes == predicted


def test_queued_micro_batches_are_never_lost_or_mixed(tmp_path) -> None:
    """A checkpoint with micro-batches queued is refused (a resume would drop them); a load
    drops the queue (they belong to no step of the loaded run); once auto chose vertical, a
    horizontal forward is refused instead of running beside the queue."""
    cfg = config(
        fresh(tmp_path, "a"), PLACEMENTS["everything-on-nvme"], accumulate=2, schedule="auto"
    )
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        saved = engine.save_checkpoint(tmp_path / "run")
        engine.train_micro_batch(data.next_batch())
        assert engine.vertical.on
        with pytest.raises(TierzeroError, match="1 of 2 micro-batches are queued"):
            engine.save_checkpoint(tmp_path / "run")
        with pytest.raises(ConfigError, match="call train_micro_batch"):
            engine.forward(data.next_batch())
        engine.load_checkpoint(saved)
        engine.train_micro_batch(data.next_batch())
        # one micro-batch of the loaded run's step, not two
        assert engine.parts.counters.state.step_count == 0


def test_waiting_activations_that_cannot_spill_are_refused_before_the_step(tmp_path) -> None:
    cfg = config(
        fresh(tmp_path, "a"),
        PLACEMENTS["all-gpu"],
        accumulate=2,
        schedule="vertical",
        activation_budget=4096,
    )
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        with pytest.raises(ConfigError, match="no state lives on NVMe to spill them to"):
            engine.train_micro_batch(batches().next_batch())
        assert engine.parts.counters.state.step_count == 0


def test_activation_buffers_are_allocated_in_the_first_step_only(tmp_path, monkeypatch) -> None:
    """Freed host buffers are reused (on a GPU each new one would also be pinned): with spills
    every step, the steps after the first allocate none."""
    from tierzero.engine.vertical import boundary

    allocations: list[int] = []
    real = boundary.aligned_empty
    monkeypatch.setattr(
        boundary, "aligned_empty", lambda n, dtype: allocations.append(n) or real(n, dtype)
    )
    cfg = config(
        fresh(tmp_path, "v"),
        PLACEMENTS["everything-on-nvme"],
        accumulate=K,
        schedule="vertical",
        activation_budget=2 * 4 * 32 * SMALL.dim * 4,
    )
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        for step in range(3):
            for _ in range(K):
                engine.train_micro_batch(data.next_batch())
            if step == 0:
                first = len(allocations)
        assert engine.vertical.store.spilled > 2 * K
    assert 0 < first == len(allocations)
