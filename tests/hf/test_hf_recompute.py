"""`--recompute auto` on Hugging Face decoders, whose shape says nothing of their activations.

The first step recomputes every unit and measures what each unit's graph would hold (the
tensors autograd saves, counted as `SavedTensors` counts them); from then on the engine keeps
the graphs that fit the compute device's budget beside the measured checkpoints and recompute.
fp32, one rank, every state on NVMe: a dense LLaMA (its head untied, so it keeps a graph too)
and a mixture of experts, horizontally and in the vertical schedule, leave weights bitwise
equal to `--recompute all`, each kept unit's forward run once per micro-batch after the first
step; a micro-batch larger than the one measured recomputes every unit; a budget with room
for the head's graph and one layer's keeps those two.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.engine import engine_config
from tests.support.hf import save_model
from tierzero import Engine, Placement, Tier
from tierzero.hf import load_model
from tierzero.run.data import TokenBatches, default_corpus

K, STEPS = 2, 3
NVME = Placement(*[Tier.NVME] * 5)
config = partial(
    engine_config, dtype="fp32", total_steps=STEPS, accumulate=K, host_budget=None, gpu_budget=None
)


def save_moe(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    cfg = MixtralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=256,
        max_position_embeddings=128,
        output_router_logits=False,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, max_shard_size="60KB")
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recompute-models")
    return {
        "llama": save_model("llama", root / "llama", tie_word_embeddings=False),
        "mixtral": save_moe(root / "mixtral"),
    }


def run(
    model_dir: Path,
    path: Path,
    monkeypatch: pytest.MonkeyPatch,
    schedule: str = "horizontal",
    recompute: str = "auto",
    sizes: list[tuple[int, int]] | None = None,
    **overrides: Any,
) -> tuple[dict, Engine, list[int]]:
    """Final weights, the engine, and how many times the decoder layers ran in each step;
    `sizes`: each micro-batch's (batch size, sequence length), by default 2 x 32."""
    hf = load_model(f"hf:{model_dir}")
    layer = type(hf.model.model.layers[0])
    calls, forward = [0], layer.forward

    def counted(self, *args, **kwargs):
        calls[-1] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(layer, "forward", counted)
    data = TokenBatches(default_corpus(1 << 16), 2, 32, seed=0)
    cfg = config(path, placement=NVME, schedule=schedule, recompute=recompute, **overrides)
    with Engine(hf.model, cfg, weights=model_dir) as engine:
        for shape in sizes or [(2, 32)] * (STEPS * K):
            ids, targets = data.next_batch()
            x, y = ids[:1].repeat(shape[0], 2)[:, : shape[1]], targets[:1].repeat(shape[0], 2)
            steps = engine.parts.counters.state.step_count
            engine.train_micro_batch((x, y[:, : shape[1]]))
            if engine.parts.counters.state.step_count > steps:
                calls.append(0)
        weights = engine.master_state_dict()
    monkeypatch.setattr(layer, "forward", forward)
    return weights, engine, calls[:-1]


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    "arch,schedule", [("llama", "horizontal"), ("mixtral", "horizontal"), ("llama", "vertical")]
)
def test_measured_graphs_are_kept_after_the_first_step_bitwise(
    models, tmp_path, monkeypatch, arch, schedule
) -> None:
    ref, _, all_calls = run(models[arch], tmp_path / "all", monkeypatch, schedule, "all")
    weights, engine, calls = run(models[arch], tmp_path / "auto", monkeypatch, schedule)
    keeping, units = engine.opened.runner.keeping, engine.parts.layout.units
    blocks = {u.index for u in units if u.kind == "block"}
    head = set() if schedule == "vertical" else {units[-1].index}  # vertically: none to keep
    assert keeping.units == blocks | head
    assert all(keeping.measured[i] > 0 for i in blocks | head)
    layers = len(blocks)
    assert all_calls == [2 * layers * K] * STEPS  # each layer's forward, then its recompute
    assert calls == [2 * layers * K] + [layers * K] * (STEPS - 1)  # measured, then kept
    same(weights, ref)


def test_a_larger_micro_batch_than_measured_recomputes(models, tmp_path, monkeypatch) -> None:
    sizes = [(2, 32)] * K + [(2, 48), (2, 32)] + [(1, 32)] * K
    ref, _, _ = run(models["llama"], tmp_path / "all", monkeypatch, recompute="all", sizes=sizes)
    weights, engine, calls = run(models["llama"], tmp_path / "auto", monkeypatch, sizes=sizes)
    assert engine.opened.runner.keeping.tokens == 64
    assert calls == [4 * K, 4 + 2, 2 * K]  # step 2's first micro-batch is larger: recomputed
    same(weights, ref)


def test_a_budget_with_room_for_the_head_and_one_layer_keeps_them(
    models, tmp_path, monkeypatch
) -> None:
    """The room left beside the pools and the measured working set decides, in order of the
    compute saved per byte: the head's graph, then the last layer's; the first layer is
    recomputed."""
    big = 2 * 10**9
    _, probe, _ = run(models["llama"], tmp_path / "probe", monkeypatch, host_budget=big)
    keeping, p = probe.opened.runner.keeping, probe.parts
    assert keeping.units == {1, 2, 3}
    reserved = sum(keeping.measured[i] for i in keeping.units)
    room = p.tiers.host_budget + reserved - p.sizing.current.tiers[Tier.HOST].pool_bytes
    room -= keeping.working(0)
    need = keeping.measured[3] + keeping.measured[2]
    budget = big - room + need + keeping.measured[1] // 2
    _, engine, calls = run(models["llama"], tmp_path / "two", monkeypatch, host_budget=budget)
    assert engine.opened.runner.keeping.units == {2, 3}
    assert calls[1:] == [3 * K] * (STEPS - 1)  # two layers' forwards and one recompute
    _, none, _ = run(models["llama"], tmp_path / "none", monkeypatch, host_budget=big - room)
    assert none.opened.runner.keeping.units == frozenset()
