"""Recompute only what the budget forces (`tierzero.planning.recompute`,
`engine.runtime.execute._KeptGraph`).

A block whose activations fit the compute device's budget keeps the autograd graph of its one
forward until its backward instead of being recomputed. fp32, one rank: the weights are
bitwise those of `--recompute all` (and of plain PyTorch), each kept block's forward runs once
per micro-batch instead of twice, and the memory model's count of the kept bytes is within 10%
of what the kept graphs hold.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from test_engine_exact import PLACEMENTS, config

from tests.support.engine import SMALL, assert_same, batches, fresh, reference_run
from tierzero import Config, models
from tierzero.config import Recompute, Tier
from tierzero.engine import Engine
from tierzero.engine.runtime import kept
from tierzero.engine.vertical.boundary import BoundaryStore
from tierzero.errors import ConfigError
from tierzero.models import ModelArgs
from tierzero.models.llama import Block, Transformer
from tierzero.planning.ledger import activation_memory
from tierzero.planning.recompute import choose_kept
from tierzero.planning.workload import Workload

STEPS, K = 2, 2
BLOCKS = frozenset(range(1, SMALL.n_layers + 1))  # unit 0 is the embedding, the last the head
HEAD = SMALL.n_layers + 1
UNTIED = dataclasses.replace(SMALL, tie_embeddings=False)
CHUNK_BYTES = 4 * SMALL.vocab_size * 40  # 40 tokens per loss chunk: a 4 x 32 batch takes 4 chunks


def train(
    cfg: Config,
    monkeypatch: pytest.MonkeyPatch,
    steps: int = STEPS,
    args: ModelArgs = SMALL,
    chunk_bytes: int | None = None,
) -> tuple[dict, Engine, list[int], list[int]]:
    """Final weights, the engine, the storages of every block input (one per forward run) and
    of the head's inputs (two per run: hidden state and targets)."""
    inputs: list[int] = []
    head_inputs: list[int] = []
    forward, head_out = Block.forward, Transformer.head_out

    def counted(self: Block, x: torch.Tensor) -> torch.Tensor:
        inputs.append(x.untyped_storage().data_ptr())
        return forward(self, x)

    def counted_head(
        self: Transformer, x: torch.Tensor, targets: torch.Tensor | None = None, *rest: Any
    ) -> torch.Tensor:
        head_inputs.extend(t.untyped_storage().data_ptr() for t in (x, targets) if t is not None)
        return head_out(self, x, targets, *rest)

    monkeypatch.setattr(Block, "forward", counted)
    monkeypatch.setattr(Transformer, "head_out", counted_head)
    data = batches()
    model = models.build(args, device="meta", seed=cfg.seed)
    if chunk_bytes is not None:
        model.loss_chunk_bytes = chunk_bytes
    with Engine(model, cfg) as engine:
        for _ in range(steps * cfg.execution.accumulate):
            engine.train_micro_batch(data.next_batch())
        weights = engine.master_state_dict()
    monkeypatch.setattr(Block, "forward", forward)
    monkeypatch.setattr(Transformer, "head_out", head_out)
    return weights, engine, inputs, head_inputs


def all_and_auto(
    tmp_path, monkeypatch, name: str, schedule: str, before_each: Any = lambda: None
) -> dict[str, tuple[dict, Engine, list[int], list[int]]]:
    """`train` under `--recompute all`, then `auto`, k micro-batches a step in `schedule`."""
    runs = {}
    for recompute in ("all", "auto"):
        before_each()
        cfg = config(
            fresh(tmp_path, recompute),
            PLACEMENTS[name],
            accumulate=K,
            recompute=recompute,
            schedule=schedule,
        )
        runs[recompute] = train(cfg, monkeypatch)
    return runs


@pytest.mark.parametrize("name", ["all-gpu", "everything-on-nvme"])
def test_kept_graphs_are_bitwise_equal_to_recompute_and_run_each_forward_once(
    tmp_path, monkeypatch, name
) -> None:
    runs = all_and_auto(tmp_path, monkeypatch, name, "horizontal")
    _, ref = reference_run(
        SMALL, config(fresh(tmp_path, "ref"), PLACEMENTS[name], accumulate=K), steps=STEPS
    )
    micro_batches = STEPS * K
    assert runs["all"][1].opened.runner.keeping.units == frozenset()
    assert len(runs["all"][2]) == 2 * SMALL.n_layers * micro_batches  # forward, then recompute
    weights, engine, inputs, _ = runs["auto"]  # the budget holds every block's activations
    assert engine.opened.runner.keeping.units == BLOCKS
    assert len(inputs) == SMALL.n_layers * micro_batches
    assert_same(weights, runs["all"][0])
    assert_same(runs["all"][0], ref)


@pytest.mark.parametrize("name", ["all-gpu", "everything-on-nvme"])
def test_the_vertical_schedule_keeps_a_graph_per_micro_batch(tmp_path, monkeypatch, name) -> None:
    """Vertically each kept block's forward sweep keeps one graph per micro-batch (its input
    inside it, not in the host store) and the backward sweep backprops them: bitwise the
    weights of recomputing every block, each block's forward run once per micro-batch."""
    puts: list[tuple[int, int]] = []
    put = BoundaryStore.put
    monkeypatch.setattr(BoundaryStore, "put", lambda self, *a: puts.append(a[:2]) or put(self, *a))
    runs = all_and_auto(tmp_path, monkeypatch, name, "vertical", before_each=puts.clear)
    micro_batches = STEPS * K
    weights, engine, inputs, _ = runs["auto"]
    assert engine.vertical.on and runs["all"][1].vertical.on
    assert len(runs["all"][2]) == 2 * SMALL.n_layers * micro_batches
    assert engine.opened.runner.keeping.units == BLOCKS
    act = engine.parts.sizing.activations
    assert act.vertical == K and act.kept_bytes == SMALL.n_layers * act.block_kept_bytes
    assert act.block_kept_bytes == K * (act.recompute_bytes + act.hidden_bytes)
    assert len(inputs) == SMALL.n_layers * micro_batches
    # no block input waited in the host store; the tied embedding's grads from the head did
    assert {unit for unit, _ in puts} == {0}
    assert_same(weights, runs["all"][0])


@pytest.mark.parametrize(
    "chunk_bytes", [None, CHUNK_BYTES], ids=["one-loss-chunk", "four-loss-chunks"]
)
def test_an_untied_head_keeps_its_graph_too(tmp_path, monkeypatch, chunk_bytes) -> None:
    place = PLACEMENTS["everything-on-nvme"]
    ref, _, _, heads_all = train(
        config(fresh(tmp_path, "all"), place, recompute="all"),
        monkeypatch,
        args=UNTIED,
        chunk_bytes=chunk_bytes,
    )
    weights, engine, _, heads = train(
        config(fresh(tmp_path, "auto"), place), monkeypatch, args=UNTIED, chunk_bytes=chunk_bytes
    )
    assert engine.opened.runner.keeping.units == BLOCKS | {HEAD}
    assert len(heads_all) == 2 * 2 * STEPS and len(heads) == 2 * STEPS  # (hidden, targets) per run
    assert_same(weights, ref)


@pytest.mark.parametrize(
    "args,schedule",
    [(SMALL, "horizontal"), (UNTIED, "horizontal"), (SMALL, "vertical")],
    ids=["tied", "untied", "vertical"],
)
def test_the_memory_model_counts_what_kept_graphs_hold(
    tmp_path, monkeypatch, args, schedule
) -> None:
    """The tensors the engine's kept graphs save in a step (params saved by their place in the
    buffer, unit inputs counted as checkpoints, or vertically as the k hidden states a kept
    block's graphs hold) against `kept_bytes`: within 10%."""
    storages: dict[int, int] = {}
    pack = kept.SavedTensors.pack

    def spy(self: kept.SavedTensors, t: torch.Tensor):
        saved = pack(self, t)
        if isinstance(saved, torch.Tensor):
            storages[saved.untyped_storage().data_ptr()] = saved.untyped_storage().nbytes()
        return saved

    monkeypatch.setattr(kept.SavedTensors, "pack", spy)
    vertical = schedule == "vertical"
    cfg = config(
        tmp_path,
        PLACEMENTS["param-on-host"],
        recompute="auto" if vertical else "none",
        schedule=schedule,
        accumulate=K if vertical else 1,
    )
    _, engine, inputs, heads = train(cfg, monkeypatch, steps=1, args=args)
    measured = sum(n for ptr, n in storages.items() if ptr not in {*inputs, *heads})
    act = engine.parts.sizing.activations
    assert act.kept_blocks == SMALL.n_layers and act.kept_head is (not args.tie_embeddings)
    if vertical:  # each graph holds its block's input too
        assert act.vertical == K
        measured += K * SMALL.n_layers * act.hidden_bytes
    assert measured <= act.kept_bytes <= 1.1 * measured


def test_a_budget_for_one_block_keeps_the_last_one(tmp_path, monkeypatch) -> None:
    placement = PLACEMENTS["param-on-host"]
    _, probe, _, _ = train(
        config(fresh(tmp_path, "probe"), placement, recompute="all"), monkeypatch, steps=1
    )
    # what keeping could use
    room = probe.parts.tiers.host_budget - probe.parts.sizing.current.tiers[Tier.HOST].pool_bytes
    per = probe.parts.sizing.activations.recompute_bytes
    budget = probe.config.tiering.host_budget - room + 3 * per // 2
    one = config(fresh(tmp_path, "one"), placement).replace(host_budget=budget)
    weights, engine, inputs, _ = train(one, monkeypatch, steps=2)
    # the last block: freed first in backward
    assert engine.opened.runner.keeping.units == frozenset({SMALL.n_layers})
    assert engine.parts.sizing.activations.kept_blocks == 1
    assert len(inputs) == (2 * SMALL.n_layers - 1) * 2
    reference, _, _, _ = train(
        config(fresh(tmp_path, "all"), placement, recompute="all"), monkeypatch, steps=2
    )
    assert_same(weights, reference)
    with pytest.raises(ConfigError, match="--recompute none keeps 3 units' activations"):
        train(
            one.replace(recompute="none", nvme_path=[str(fresh(tmp_path, "none") / "nvme")]),
            monkeypatch,
            steps=1,
        )


def test_choose_kept_by_hand() -> None:
    """Untied: the head saves the most compute per byte (its logits' matmul against a saved
    norm output and log-softmax), then the blocks from the last."""
    units = Workload.from_preset(UNTIED, 4).units
    act = activation_memory(UNTIED, 4, 32, 4, CHUNK_BYTES)
    per, head = act.recompute_bytes, act.head_kept_bytes
    assert head < per
    assert choose_kept(Recompute.AUTO, units, act, head + 2 * per) == {HEAD, 3, 2}
    assert choose_kept(Recompute.AUTO, units, act, 2 * per) == {HEAD, 3}  # the head, then what fits
    assert choose_kept(Recompute.AUTO, units, act, -5) == frozenset()
    assert choose_kept(Recompute.ALL, units, act, 10 * per) == frozenset()
    assert choose_kept(Recompute.NONE, units, act, head + 3 * per) == {1, 2, 3, HEAD}
    with pytest.raises(ConfigError, match="use --recompute auto"):
        choose_kept(Recompute.NONE, units, act, head + 3 * per - 1)
    tied = Workload.from_preset(SMALL, 4).units  # the head binds the embedding: recomputed
    assert choose_kept(Recompute.NONE, tied, activation_memory(SMALL, 4, 32, 4), 10**9) == BLOCKS


def test_config_refuses_an_unknown_recompute() -> None:
    with pytest.raises(
        ConfigError, match="recompute 'some' is not valid; choose one of auto|all|none"
    ):
        Config(recompute="some")
