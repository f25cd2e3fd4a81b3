"""One step's loss on masked data is the mean over the global batch's trained tokens, however
the batch is laid out: 4 rows at once, 2 rows x accumulate 2, or 2 ranks x 2 rows each.

The data is prompt/completion-like: trained targets come in runs of very different density, so
the step's 4 rows hold very different numbers of them, and a mean of the micro-batches' means
(what the engine computed before `step_tokens`) is measurably off (asserted below: > 1e-3).

Compared, for the built-in model and a tiny Hugging Face Llama (from config), fp32:
- 4 rows at once against plain PyTorch (`F.cross_entropy` over the whole batch, AdamW): the
  same ops, so bitwise for the built-in model; the HF model through its units within 1e-6.
- 2 rows x accumulate 2 (horizontal and, for the built-in model, vertical) against 4 rows:
  another summation order, so losses within 1e-6 and weights within a stated tolerance.
- 2 ranks x 2 rows (gloo, two CPU processes) against 2 rows x accumulate 2: the same sums in
  the same order (the ranks' mean halves a sum exactly, as the accumulation's /2 does), so
  bitwise losses and weights for both models. Both are untied: a tied embedding's grads from its
  two uses would be added in another order on each layout (ulp-level differences).

Weights: 3 AdamW steps at lr 1e-3. Adam divides by sqrt(v), so an element whose gradient is
near zero moves ~lr on a last-bit difference in it; stated tolerance 2e-5 (observed below 1e-6
for nearly every element), against the 1e-3-scale differences of a mean of means.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.support.engine import SMALL, engine_config
from tierzero import Config, Placement, Tier, models
from tierzero.adamw import decays
from tierzero.engine import Engine
from tierzero.errors import ConfigError
from tierzero.lr import lr_at
from tierzero.models.loss import trained_targets
from tierzero.run.data import TokenBatches, default_corpus

STEPS, LR, ROWS, SEQ = 3, 1e-3, 4, 32
LOSS_TOL, WEIGHT_TOL = 1e-6, 2e-5
UNTIED = dataclasses.replace(SMALL, tie_embeddings=False)


@functools.cache
def masked_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches of 4 rows whose trained targets vary from a few to most per row."""
    tokens = default_corpus(1 << 16)
    rng = np.random.default_rng(0)
    density = np.repeat(rng.choice([0.03, 0.9], size=len(tokens) // 64 + 1), 64)[: len(tokens)]
    trained = (rng.random(len(tokens)) < density).astype(np.uint8)
    data = TokenBatches(tokens, ROWS, SEQ, seed=0, trained=trained)
    return [data.next_batch() for _ in range(STEPS)]


def hf_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tierzero.hf.build import adapt

    torch.manual_seed(0)
    return adapt(
        LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=256,
                max_position_embeddings=64,
                tie_word_embeddings=False,
            )
        )
    )


def build(kind: str, meta: bool = False) -> torch.nn.Module:
    return (
        models.build(UNTIED, device="meta" if meta else "cpu", seed=0)
        if kind == "builtin"
        else hf_model()
    )


config = functools.partial(  # this file's values: no device budget (the engine chooses)
    engine_config,
    placement=Placement(Tier.NVME, Tier.HOST, Tier.NVME, Tier.NVME, Tier.HOST),
    lr=LR,
    warmup_steps=0,
    total_steps=STEPS,
    gpu_budget=None,
)


def plain(
    kind: str, micro: int = ROWS, exact: bool = True
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: each step's rows in micro-batches of `micro`; with `exact` each one's summed
    token loss over the step's count (the definition), else its own mean over the number of
    micro-batches (a mean of means). Its step losses and final weights."""
    model = build(kind)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if decays(p)], "weight_decay": 0.1},
            {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )  # as the engine (`tierzero.adamw`)
    losses, schedule = [], config(".")
    for number, (x, y) in enumerate(masked_batches()):
        step, k = 0.0, ROWS // micro
        for m in range(k):
            xm, ym = x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]
            logits = model(xm).float().flatten(0, 1)
            if exact and k == 1:
                loss = F.cross_entropy(logits, ym.flatten())
            elif exact:
                loss = F.cross_entropy(logits, ym.flatten(), reduction="sum") / (
                    trained_targets(y) / k
                )
            else:
                loss = F.cross_entropy(logits, ym.flatten())
            (loss / k if k > 1 else loss).backward()
            step += loss.item() / k
        for group in opt.param_groups:
            group["lr"] = lr_at(number, schedule.optimizer)
        opt.step()
        opt.zero_grad()
        losses.append(step)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def tiered(
    kind: str, root, accumulate: int = 1, rank: int = 0, world_size: int = 1, **kw
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The engine on this rank's rows of each global batch, in `accumulate` micro-batches, told
    the step's trained tokens; its step losses (the mean of its micro-batches') and weights."""
    rows = ROWS // world_size
    micro = rows // accumulate
    losses = []
    with Engine(
        build(kind, meta=True) if kind == "builtin" else build(kind),
        config(root, accumulate=accumulate, **kw),
    ) as engine:
        for x, y in masked_batches():
            x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
            tokens = trained_targets(y)
            if world_size > 1:
                tokens = int(engine.parts.layout.comm.total([tokens])[0])
            out = [
                engine.train_micro_batch(
                    (x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]),
                    step_tokens=tokens,
                )
                for m in range(accumulate)
            ]
            loss = sum(t.item() for t in out) / accumulate
            losses.append(loss if world_size == 1 else engine.parts.layout.comm.mean([loss])[0])
        return losses, engine.master_state_dict()


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for key in b:
        assert torch.equal(a[key], b[key]), key


def test_the_data_makes_a_mean_of_means_measurably_wrong() -> None:
    exact, _ = plain("builtin")
    mean_of_means, _ = plain("builtin", micro=2, exact=False)
    assert max(abs(a - b) for a, b in zip(exact, mean_of_means)) > 1e-3
    counts = [trained_targets(y[:2]) - trained_targets(y[2:]) for _, y in masked_batches()]
    assert max(abs(c) for c in counts) > 10


@pytest.mark.parametrize("kind", ["builtin", "hf"])
def test_four_rows_at_once_are_plain_pytorch(kind, tmp_path) -> None:
    losses, weights = tiered(kind, tmp_path)
    expected, expected_weights = plain(kind)
    if kind == "builtin":  # the same ops: bitwise
        assert losses == expected
        assert_equal(weights, expected_weights)
    else:  # through the HF model's units (its head's own loss code): within summation order
        assert max(abs(a - b) for a, b in zip(losses, expected)) <= LOSS_TOL
        assert_close(weights, expected_weights, WEIGHT_TOL)


@pytest.mark.parametrize(
    "kind,schedule", [("builtin", "horizontal"), ("builtin", "vertical"), ("hf", "horizontal")]
)
def test_two_rows_accumulated_twice_are_the_four_rows(kind, schedule, tmp_path) -> None:
    losses, weights = tiered(kind, tmp_path, accumulate=2, schedule=schedule)
    same_order, same_order_weights = plain(kind, micro=2)
    if kind == "builtin":  # the same micro-batches and sums as plain PyTorch accumulating exactly
        assert losses == same_order
        assert_equal(weights, same_order_weights)
    four, four_weights = plain(kind)
    assert max(abs(a - b) for a, b in zip(losses, four)) <= LOSS_TOL
    assert_close(weights, four_weights, WEIGHT_TOL)


def _rank(rank: int, root: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2
    )
    try:
        for kind in ("builtin", "hf"):
            Path(root, kind).mkdir(exist_ok=True)
            losses, weights = tiered(kind, f"{root}/{kind}", rank=rank, world_size=2)
            if rank == 0:
                weights = {k: v.contiguous() for k, v in weights.items()}
                save_file(weights, f"{root}/{kind}.safetensors", metadata={"losses": repr(losses)})
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    from safetensors import safe_open

    root = tmp_path_factory.mktemp("ranks")
    mp.spawn(_rank, args=(str(root),), nprocs=2, join=True)
    out = {}
    for kind in ("builtin", "hf"):
        with safe_open(str(root / f"{kind}.safetensors"), "pt") as f:
            losses = [float(v) for v in f.metadata()["losses"].strip("[]").split(",")]
        out[kind] = losses, load_file(str(root / f"{kind}.safetensors"))
    return out


@pytest.mark.parametrize("kind", ["builtin", "hf"])
def test_two_ranks_of_two_rows_are_two_rows_accumulated_twice(kind, two_ranks, tmp_path) -> None:
    losses, weights = two_ranks[kind]
    accumulated, accumulated_weights = tiered(kind, tmp_path, accumulate=2)
    assert losses == accumulated
    assert_equal(weights, accumulated_weights)
    four, four_weights = plain(kind)
    assert max(abs(a - b) for a, b in zip(losses, four)) <= LOSS_TOL
    assert_close(weights, four_weights, WEIGHT_TOL)


def test_hf_labels_are_divided_by_the_given_count_and_a_model_without_it_is_refused() -> None:
    """`labels=` (unshifted: the model's own loss shifts them) takes the same divisor."""
    from tierzero.reference import ReferenceTrainer

    x, y = masked_batches()[0]
    # x's tokens then its targets: shifted back by the model
    labels = torch.cat([x[:, :1], y], dim=1)
    model = hf_model()
    with torch.no_grad():
        logits = model(x).float().flatten(0, 1)
        summed = F.cross_entropy(logits, y.flatten(), reduction="sum")
        got = model(torch.cat([x, y[:, -1:]], dim=1), labels=labels, num_items_in_batch=7.5)
    torch.testing.assert_close(got, summed / 7.5, rtol=1e-6, atol=0)

    class NoCount(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.w * 0

    trainer = ReferenceTrainer(NoCount(), Config(offload="none"))
    trainer.train_micro_batch((x, y))  # without step_tokens: its own loss
    with pytest.raises(ConfigError, match="takes no num_items_in_batch"):
        trainer.train_micro_batch((x, y), step_tokens=np.int64(10))
