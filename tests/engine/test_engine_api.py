"""The Python API beyond a training step: autocast around `forward`, `gathered` weights.

Compared with plain PyTorch (`ReferenceTrainer`, or the model in memory with
`torch.optim.AdamW`): fp32 weights, one rank, bitwise where the computation is the same.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from tests.support.engine import SMALL, batches, engine_config
from tierzero import Placement, Tier, models
from tierzero.engine import Engine
from tierzero.errors import ConfigError
from tierzero.models.loss import compute_loss
from tierzero.reference import ReferenceTrainer

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)


# this file's values
config = partial(engine_config, warmup_steps=2, total_steps=4, piece_numel=6144)


def test_recompute_runs_under_the_autocast_of_the_forward(tmp_path) -> None:
    """A user's `torch.autocast` around `engine.forward` is captured per unit and restored for
    its recompute in backward: the same numerics as plain PyTorch under autocast (bf16 on the
    CPU), which `ReferenceTrainer` runs for dtype bf16 over fp32 weights."""
    reference = ReferenceTrainer(models.build(SMALL, seed=0), config(tmp_path, dtype="bf16"))
    data = batches()
    ref_losses = [reference.train_step(data.next_batch()) for _ in range(2)]
    data = batches()
    losses = []
    with Engine(
        models.build(SMALL, device="meta", seed=0), config(tmp_path, dtype="fp32")
    ) as engine:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = engine.forward(data.next_batch())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        weights = engine.master_state_dict()
    assert losses == ref_losses
    for key, value in reference.master_state_dict().items():
        assert torch.equal(weights[key], value), key


UNTIED = dataclasses.replace(SMALL, tie_embeddings=False)
REGULARISED = (
    "blocks.0.attn.wq.weight",
    "blocks.2.mlp.w_down.weight",
    "head.weight",
    "norm.weight",
)


def regulariser(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """An L2 penalty on some weights, pulling others towards them: any function of the weights."""
    return (
        0.05 * sum(weights[n].square().sum() for n in REGULARISED[:3])
        + (weights["norm.weight"] - 0.5).abs().sum()
    )


@pytest.mark.parametrize("overlap,accumulate", [(False, 1), (True, 2)])
def test_regulariser_on_gathered_weights_gives_the_plain_models_gradients(
    tmp_path, overlap: bool, accumulate: int
) -> None:
    """loss + regulariser(weights) through `engine.gathered` trains bitwise as plain PyTorch with
    the same regulariser on the model's own parameters: its gradients reach the grad shards."""
    cfg = config(tmp_path, overlap_step=overlap, accumulate=accumulate)
    model = models.build(UNTIED, seed=0)
    trainer = ReferenceTrainer(model, cfg)  # its optimizer and lr schedule; the loss is ours
    data = batches()
    for _ in range(2 * accumulate):
        loss = compute_loss(model, data.next_batch()) + regulariser(dict(model.named_parameters()))
        (loss / accumulate).backward()
        trainer.micro_step += 1
        if trainer.micro_step % accumulate == 0:
            trainer._step()
    data = batches()
    with Engine(models.build(UNTIED, device="meta", seed=0), cfg) as engine:
        for _ in range(2 * accumulate):
            loss = engine.forward(data.next_batch())
            with engine.gathered(REGULARISED) as weights:
                assert set(weights) == set(REGULARISED) and all(
                    w.requires_grad for w in weights.values()
                )
                engine.backward(loss + regulariser(weights))
            assert not weights  # released
            engine.step()
        final = engine.master_state_dict()
    for key, value in trainer.master_state_dict().items():
        assert torch.equal(final[key], value), key


def test_gathered_weights_are_the_current_ones_and_names_are_checked(tmp_path) -> None:
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=0), config(tmp_path)) as engine:
        engine.train_step(data.next_batch())
        with torch.no_grad(), engine.gathered() as weights:
            master = engine.master_state_dict()
            assert weights.keys() == master.keys()
            assert weights["head.weight"] is weights["tok_emb.weight"]  # tied: one tensor
            for name, value in master.items():
                assert torch.equal(weights[name], value), name
        with pytest.raises(ConfigError, match="'nope' is not a parameter of the model"):
            with engine.gathered(["nope"]):
                pass


def test_backward_after_the_gathered_block_closed_is_refused(tmp_path) -> None:
    """A loss built on gathered copies must be backpropagated inside the block: after it, the
    gradients through them would be lost, so the engine refuses before accumulating anything,
    and the same micro-batch then trains as if the mistake had not happened."""
    data = batches()
    cfg = config(tmp_path, placement=Placement(*[Tier.HOST] * 5))
    with Engine(models.build(UNTIED, device="meta", seed=0), cfg) as engine:
        batch = data.next_batch()
        loss = engine.forward(batch)
        with engine.gathered(REGULARISED) as weights:
            penalty = regulariser(weights)
        with pytest.raises(ConfigError, match="gathered. block that has closed"):
            engine.backward(loss + penalty)
        engine.backward(loss)  # the same loss alone: its graph never touched the copies
        engine.step()
        after_retry = engine.master_state_dict()
    with Engine(models.build(UNTIED, device="meta", seed=0), cfg) as engine:
        engine.train_step(batch)
        plain = engine.master_state_dict()
    for key, value in plain.items():
        assert torch.equal(after_retry[key], value), key


def test_train_micro_batch_is_train_step_with_the_loss_left_on_the_device(tmp_path) -> None:
    """`train_micro_batch` (what the CLI loop calls, reading the losses once per step) gives a
    detached loss tensor whose value is `train_step`'s float, and trains bitwise like plain
    PyTorch."""
    cfg = config(
        tmp_path,
        placement=Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST),
        accumulate=2,
    )
    reference = ReferenceTrainer(models.build(SMALL, seed=0), cfg)
    data = batches()
    ref_losses = [reference.train_step(data.next_batch()) for _ in range(4)]
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=0), cfg) as engine:
        losses = [engine.train_micro_batch(data.next_batch()) for _ in range(4)]
        assert engine.step_count == 2
        weights = engine.master_state_dict()
    assert all(t.dim() == 0 and not t.requires_grad for t in losses)
    assert [t.item() for t in losses] == ref_losses
    for key, value in reference.master_state_dict().items():
        assert torch.equal(weights[key], value), key
