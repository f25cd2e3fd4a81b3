"""Recompute only what the budget forces (`tierzero.planning.recompute`, `engine.execute._KeptGraph`).

A block whose activations fit the compute device's budget keeps the autograd graph of its one
forward until its backward instead of being recomputed. fp32, one rank: the weights are
bitwise those of `--recompute all` (and of plain PyTorch), each kept block's forward runs once
per micro-batch instead of twice, and the memory model's count of the kept bytes is within 10%
of what the kept graphs hold.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tierzero import Config, models
from tierzero.config import Recompute, Tier
from tierzero.engine import Engine, execute
from tierzero.errors import ConfigError
from tierzero.models.llama import Block
from tierzero.planning.ledger import activation_memory
from tierzero.planning.recompute import kept_count, kept_units

from engine_helpers import SMALL, batches, reference_run
from test_engine_exact import PLACEMENTS, config

STEPS, K = 2, 2
BLOCKS = frozenset(range(1, SMALL.n_layers + 1))  # unit 0 is the embedding, the last the head


def train(cfg: Config, monkeypatch: pytest.MonkeyPatch, steps: int = STEPS) -> tuple[dict, Engine, list[int]]:
    """Final weights, the engine, and the storages of every block input (one per forward run)."""
    inputs: list[int] = []
    forward = Block.forward

    def counted(self: Block, x: torch.Tensor) -> torch.Tensor:
        inputs.append(x.untyped_storage().data_ptr())
        return forward(self, x)

    monkeypatch.setattr(Block, "forward", counted)
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        for _ in range(steps * cfg.accumulate):
            engine.train_micro_batch(data.next_batch())
        weights = engine.master_state_dict()
    monkeypatch.setattr(Block, "forward", forward)
    return weights, engine, inputs


def fresh(tmp_path, name: str):
    """A directory of its own under `tmp_path` (one engine's nvme store)."""
    (tmp_path / name).mkdir()
    return tmp_path / name


def assert_same(weights: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == ref.keys()
    for key in ref:
        assert torch.equal(weights[key], ref[key]), key


@pytest.mark.parametrize("name", ["all-gpu", "everything-on-nvme"])
def test_kept_graphs_are_bitwise_equal_to_recompute_and_run_each_forward_once(tmp_path, monkeypatch, name) -> None:
    runs = {}
    for recompute in ("all", "auto"):
        cfg = config(fresh(tmp_path, recompute), PLACEMENTS[name], accumulate=K, recompute=recompute)
        runs[recompute] = train(cfg, monkeypatch)
    _, ref = reference_run(SMALL, config(fresh(tmp_path, "ref"), PLACEMENTS[name], accumulate=K), steps=STEPS)
    micro_batches = STEPS * K
    assert runs["all"][1].runner.kept == frozenset()
    assert len(runs["all"][2]) == 2 * SMALL.n_layers * micro_batches  # forward, then recompute
    weights, engine, inputs = runs["auto"]  # the budget holds every block's activations
    assert engine.runner.kept == BLOCKS
    assert len(inputs) == SMALL.n_layers * micro_batches
    assert_same(weights, runs["all"][0])
    assert_same(runs["all"][0], ref)


def test_the_memory_model_counts_what_kept_graphs_hold(tmp_path, monkeypatch) -> None:
    """The tensors the engine's kept graphs save (params saved by their place in the buffer,
    block inputs counted as checkpoints) against `kept_bytes`: within 10%."""
    storages: dict[int, int] = {}
    pack = execute._ParamViews.pack

    def spy(self: execute._ParamViews, t: torch.Tensor):
        saved = pack(self, t)
        if isinstance(saved, torch.Tensor):
            storages[saved.untyped_storage().data_ptr()] = saved.untyped_storage().nbytes()
        return saved

    monkeypatch.setattr(execute._ParamViews, "pack", spy)
    _, engine, inputs = train(config(tmp_path, PLACEMENTS["param-on-host"], recompute="none"), monkeypatch, steps=1)
    measured = sum(n for ptr, n in storages.items() if ptr not in set(inputs))
    predicted = engine.sizing.activations.kept_bytes
    assert engine.sizing.activations.kept_blocks == SMALL.n_layers
    assert measured <= predicted <= 1.1 * measured


def test_a_budget_for_one_block_keeps_the_last_one(tmp_path, monkeypatch) -> None:
    placement = PLACEMENTS["param-on-host"]
    _, probe, _ = train(config(fresh(tmp_path, "probe"), placement, recompute="all"), monkeypatch, steps=1)
    room = probe.tiers.host_budget - probe.memory.tiers[Tier.HOST].pool_bytes  # what keeping could use
    per = probe.sizing.activations.recompute_bytes
    budget = probe.config.host_budget - room + 3 * per // 2
    one = dataclasses.replace(config(fresh(tmp_path, "one"), placement), host_budget=budget)
    weights, engine, inputs = train(one, monkeypatch, steps=2)
    assert engine.runner.kept == frozenset({SMALL.n_layers})  # the last block: freed first in backward
    assert engine.sizing.activations.kept_blocks == 1
    assert len(inputs) == (2 * SMALL.n_layers - 1) * 2
    reference, _, _ = train(config(fresh(tmp_path, "all"), placement, recompute="all"), monkeypatch, steps=2)
    assert_same(weights, reference)
    with pytest.raises(ConfigError, match="--recompute none keeps 3 blocks' activations"):
        train(dataclasses.replace(one, recompute="none", nvme_path=[str(fresh(tmp_path, "none") / "nvme")]),
              monkeypatch, steps=1)


def test_kept_count_by_hand() -> None:
    act = activation_memory(SMALL, 4, 32, 4)
    per = act.recompute_bytes
    assert kept_count(Recompute.AUTO, 3, act, 2 * per + 1) == 2
    assert kept_count(Recompute.AUTO, 3, act, -5) == 0
    assert kept_count(Recompute.AUTO, 3, act, 10 * per) == 3
    assert kept_count(Recompute.ALL, 3, act, 10 * per) == 0
    assert kept_count(Recompute.NONE, 3, act, 3 * per) == 3
    with pytest.raises(ConfigError, match="use --recompute auto"):
        kept_count(Recompute.NONE, 3, act, 3 * per - 1)


def test_config_refuses_an_unknown_recompute() -> None:
    with pytest.raises(ConfigError, match="recompute 'some' is not valid; choose one of auto|all|none"):
        Config(recompute="some")
