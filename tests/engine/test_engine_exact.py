"""The engine against plain PyTorch: fp32, one rank, no clipping -> bitwise equal weights.

Compared: `tierzero.Engine` training a meta-built model (materialised unit by unit) versus
`ReferenceTrainer` (the model in memory, `torch.optim.AdamW`), same seed, same batches.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.support.engine import SMALL, batches, engine_config, reference_run
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.engine.runtime.binding import Unbound

PLACEMENTS = {
    "all-gpu": Placement(),
    "optimizer-on-host": Placement(Tier.GPU, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST),
    "param-on-host": Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST),
    "everything-on-nvme": Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME),
    "mixed": Placement(Tier.NVME, Tier.HOST, Tier.NVME, Tier.HOST, Tier.NVME),
}


PIECE_NUMEL = 6144  # smaller than every unit, and not dividing them: the last piece is short


# this file's values
config = partial(engine_config, piece_numel=PIECE_NUMEL, warmup_steps=2, total_steps=5)


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_five_steps_bitwise_equal_to_reference(tmp_path, name: str) -> None:
    cfg = config(tmp_path, PLACEMENTS[name])
    ref_losses, ref_weights = reference_run(SMALL, cfg, steps=5)
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        losses = [engine.train_step(data.next_batch()) for _ in range(5)]
        weights = engine.master_state_dict()
    assert losses == ref_losses
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key


def test_built_model_is_adopted_and_freed(tmp_path) -> None:
    cfg = config(tmp_path, PLACEMENTS["everything-on-nvme"], prefetch_depth=1)
    _, ref_weights = reference_run(SMALL, cfg, steps=3)
    model = models.build(SMALL, seed=cfg.seed)
    data = batches()
    with Engine(model, cfg) as engine:
        for _ in range(3):
            engine.train_step(data.next_batch())
        assert list(model.parameters()) == []  # the engine owns every weight now
        # storageless placeholders that say where the unit is bound (`binding.Unbound`)
        assert all(
            isinstance(t, Unbound) and t.device == torch.device("cpu")
            for t in (model.tok_emb.weight, model.blocks[0].attn.wq.weight)
        )
        weights = engine.master_state_dict()
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key


def test_tied_weights_stay_tied(tmp_path) -> None:
    cfg = config(tmp_path, PLACEMENTS["everything-on-nvme"])
    data = batches()
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        engine.train_step(data.next_batch())
        weights = engine.master_state_dict()
    assert torch.equal(weights["head.weight"], weights["tok_emb.weight"])


def test_eval_loss_matches_reference_and_leaves_no_state_behind(tmp_path) -> None:
    cfg = config(tmp_path, PLACEMENTS["everything-on-nvme"])
    x, y = batches().val_batches(1)[0]
    ref = models.build(SMALL, seed=cfg.seed)
    with torch.no_grad():
        expected = ref(x, y).item()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        assert engine.eval_loss((x, y)) == expected
        assert engine.eval_loss((x, y)) == expected
        assert engine.parts.tiers.device_pool.leased_bytes == 0


def test_stats_count_bytes_and_peaks(tmp_path) -> None:
    cfg = config(tmp_path, PLACEMENTS["everything-on-nvme"], overlap_step=False)
    data = batches()
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        engine.train_step(data.next_batch())
        stats = engine.stats()
    shard_bytes = sum(u.shard_numel for u in engine.units) * 4
    # forward + backward fetch every block's params, the root once; the step reads 4 states
    assert stats["bytes_nvme->host"] >= 5 * shard_bytes
    assert stats["bytes_host->nvme"] >= 5 * shard_bytes  # grads, master, 2 moments, params
    assert 0 < stats["peak_host_bytes"] <= 256 << 20
    assert 0 < stats["peak_gpu_bytes"] <= 256 << 20


def test_host_cache_serves_refetches_and_never_stale_params(tmp_path) -> None:
    """With room in the host budget, backward's re-fetch of a unit's params hits the LRU cache
    (no nvme read), and the next step's forward sees the params the optimizer just wrote (the
    bitwise comparison above would fail on a stale entry; here we count the traffic)."""
    cfg = config(tmp_path, PLACEMENTS["everything-on-nvme"], overlap_step=False)
    data = batches()
    with Engine(models.build(SMALL, device="meta"), cfg) as engine:
        engine.train_step(data.next_batch())
        engine.stats()
        engine.train_step(data.next_batch())
        stats = engine.stats()
    param_bytes = sum(u.shard_numel for u in engine.units) * 4
    fetched = [op.unit for op in engine.opened.train_plan.ops if op.op.value == "fetch"]
    # every unit forward, again in backward (the head stays put; the tied embedding is used by
    # the head too): every fetch is served from RAM
    assert sorted(set(fetched)) == [u.index for u in engine.units] and len(fetched) > len(
        engine.units
    )
    fetched_bytes = sum(engine.units[u].shard_numel for u in fetched) * 4
    tied_grad = engine.units[0].shard_numel * 4  # the first use's grad, back to add the second's
    assert stats["bytes_host->gpu"] == fetched_bytes + tied_grad
    assert stats["bytes_host_cache_hit"] == fetched_bytes
    assert stats["bytes_gpu->host"] == param_bytes + tied_grad  # every unit's grad, and the stash
    # the drive serves only the optimizer's four states per unit: the tied embedding's first
    # use's grad waits in host memory for the second, never on the drive
    assert stats["bytes_nvme->host"] == 4 * param_bytes


def test_auto_offload_picks_a_placement_that_fits_the_budgets(tmp_path) -> None:
    roomy = Config(
        offload="auto", nvme_path=[str(tmp_path / "nvme")], host_budget="1GiB", gpu_budget="1GiB"
    )
    assert Engine(models.build(SMALL, device="meta"), roomy).parts.layout.placement == Placement()
    tight_gpu = Config(
        offload="auto",
        nvme_path=[str(tmp_path / "nvme")],
        host_budget="1GiB",
        gpu_budget="500KB",
        prefetch_depth=0,
        lr=3e-3,
        total_steps=3,
    )
    engine = Engine(models.build(SMALL, device="meta", seed=0), tight_gpu)
    assert engine.parts.layout.placement.param is not Tier.GPU
    _, ref_weights = reference_run(SMALL, tight_gpu, steps=3)
    data = batches()
    with engine:
        for _ in range(3):
            engine.train_step(data.next_batch())
        weights = engine.master_state_dict()
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key


def test_auto_offload_says_when_nothing_fits(tmp_path) -> None:
    from tierzero.errors import ConfigError

    hopeless = Config(
        offload="auto", nvme_path=[str(tmp_path / "nvme")], host_budget="64KiB", gpu_budget="64KiB"
    )
    with pytest.raises(ConfigError, match="no placement fits the budgets"):
        Engine(models.build(SMALL, device="meta"), hopeless)


def test_init_from_local_safetensors_unit_by_unit(tmp_path) -> None:
    from safetensors.torch import save_file

    from tierzero.errors import ConfigError

    source = models.build(SMALL, seed=7)
    tensors = {k: v.contiguous() for k, v in source.state_dict().items() if k != "head.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = config(tmp_path, PLACEMENTS["everything-on-nvme"])
    with Engine(
        models.build(SMALL, device="meta"), cfg, weights=tmp_path / "model.safetensors"
    ) as engine:
        loaded = engine.master_state_dict()
    for key, value in tensors.items():
        assert torch.equal(loaded[key], value), key
    save_file({"tok_emb.weight": torch.zeros(3, 3)}, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ConfigError, match="shape"):
        Engine(
            models.build(SMALL, device="meta"),
            config(tmp_path / "b", PLACEMENTS["all-gpu"]),
            weights=tmp_path / "wrong.safetensors",
        ).open()


def test_an_unbound_parameter_says_where_its_unit_binds_and_refuses_any_use(tmp_path) -> None:
    """A model may read a weight's device before its unit is bound (Llama 4's forward moves
    `input_ids` to `embed_tokens.weight.device`); any use of its values names it instead."""
    model = models.build(SMALL, seed=0)
    with Engine(model, config(tmp_path, PLACEMENTS["everything-on-nvme"])) as engine:
        engine.train_step(batches().next_batch())
        weight = model.blocks[0].attn.wq.weight
        assert weight.device == torch.device("cpu") and weight.shape == (SMALL.dim, SMALL.dim)
        with pytest.raises(
            RuntimeError, match="blocks.0.attn.wq.weight while its unit is not bound"
        ):
            weight.sum()
