"""Budget pressure: a step that waits for buffers, and budgets the default pieces overflow.

With the host budget just above the memory model's figure, leases in the optimizer's writes
wait on the pending queue, which returns finished writes' buffers to the pool meanwhile: the
new param piece must be taken from the master buffer before the master's write can give it back.
With piece size and prefetch depth left open, a budget the defaults overflow runs with the
largest that fit (`tierzero.planning.streaming`), bitwise as the same setting given.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_out_of_core import DEEP

from tests.support.engine import batches, engine_weights, reference_run
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.errors import ConfigError
from tierzero.models import ModelArgs
from tierzero.models.llama import LOSS_CHUNK_BYTES
from tierzero.planning.ledger import activation_memory


def test_overlap_under_budget_pressure_stays_bitwise(tmp_path) -> None:
    cfg = Config(
        placement=Placement(*[Tier.NVME] * 5),
        nvme_path=[str(tmp_path / "nvme")],
        lr=3e-3,
        total_steps=5,
        host_budget=4 << 20,
        piece_numel=8192,
        prefetch_depth=2,
        overlap_step=True,
    )
    _, ref_weights = reference_run(DEEP, cfg, steps=2)
    weights = engine_weights(DEEP, cfg, steps=2)
    for key in ref_weights:
        assert torch.equal(weights[key], ref_weights[key]), key


# --- piece size and prefetch depth left to the engine: the defaults, or the largest that fit ----

WIDE = ModelArgs(
    dim=128,
    n_layers=4,
    n_heads=4,
    n_kv_heads=4,
    vocab_size=256,
    ffn_dim=384,
    max_seq_len=64,
    tie_embeddings=True,
)  # blocks of 215040 params: pieces under 256 Ki elements split them
NVME = Placement(*[Tier.NVME] * 5)


def wide_config(tmp_path, **kw) -> Config:
    return Config(
        **{
            "placement": NVME,
            "nvme_path": [str(tmp_path / "nvme")],
            "device": "cpu",
            "dtype": "fp32",
            "lr": 3e-3,
            "total_steps": 3,
            **kw,
        }
    )


def host_need(tmp_path, piece_numel: int, prefetch_depth: int) -> int:
    engine = Engine(
        models.build(WIDE, device="meta"),
        wide_config(tmp_path, piece_numel=piece_numel, prefetch_depth=prefetch_depth),
    )
    return engine.parts.sizing.current.needs()[Tier.HOST]


def test_a_budget_the_defaults_overflow_trains_with_smaller_pieces_bitwise(tmp_path) -> None:
    """At the host budget of 128 Ki-element pieces at depth 1 (and the batch's activations) the
    defaults (16 Mi, depth 2) are refused; left open, the engine takes the first rung of the
    ladder that fits -- no larger piece fits at depth 1 (each covers a whole block), nor 128 Ki
    at depth 2 -- and trains bitwise as plain PyTorch and as the same setting given."""
    # reserved at the first forward
    act = activation_memory(WIDE, 4, 32, 4, LOSS_CHUNK_BYTES).total_bytes
    budget = host_need(tmp_path, 128 << 10, 1) + act
    assert host_need(tmp_path, 256 << 10, 1) > budget and host_need(tmp_path, 128 << 10, 2) > budget
    with pytest.raises(ConfigError, match="host budget .* too small"):
        Engine(
            models.build(WIDE, device="meta"),
            wide_config(tmp_path, host_budget=budget, piece_numel=16 << 20, prefetch_depth=2),
        )
    weights = {}
    for name, kw in (("chosen", {}), ("given", {"piece_numel": 128 << 10, "prefetch_depth": 1})):
        (tmp_path / name).mkdir()
        cfg = wide_config(tmp_path / name, host_budget=budget, **kw)
        data = batches()
        with Engine(models.build(WIDE, device="meta", seed=cfg.seed), cfg) as engine:
            assert (
                engine.config.streaming.piece_numel,
                engine.config.streaming.prefetch_depth,
            ) == (128 << 10, 1)
            for _ in range(2):
                engine.train_step(data.next_batch())
            assert engine.parts.tiers.peaks()["host"] <= budget
            weights[name] = engine.master_state_dict()
    _, ref_weights = reference_run(WIDE, wide_config(tmp_path), steps=2)
    for key in ref_weights:
        assert torch.equal(weights["chosen"][key], weights["given"][key]), key
        assert torch.equal(weights["chosen"][key], ref_weights[key]), key


def test_a_roomy_budget_keeps_the_defaults(tmp_path) -> None:
    engine = Engine(models.build(WIDE, device="meta"), wide_config(tmp_path, host_budget="1GiB"))
    assert (engine.config.streaming.piece_numel, engine.config.streaming.prefetch_depth) == (
        16 << 20,
        2,
    )


def test_below_the_least_setting_the_refusal_names_host_memory_and_its_need(tmp_path) -> None:
    least = host_need(tmp_path, 64 << 10, 1)
    with pytest.raises(ConfigError) as refused:
        Engine(models.build(WIDE, device="meta"), wide_config(tmp_path, host_budget=least - 4096))
    message = str(refused.value)
    assert (
        f"need at least {least / 1e6:.1f} MB of host memory even with pieces of 64 Ki elements"
        in message
    )
    assert "prefetch depth 1, the least tierzero chooses" in message and "--host-budget" in message
    assert "gpu" not in message


def test_the_issue_134m_untied_on_nvme_fits_512mib_of_host_memory(tmp_path) -> None:
    """Issue 22's case: 134M parameters (GPT-3 small's shape with LLaMA's blocks, vocab 32000,
    untied), fp32, everything on nvme, --host-budget 512MiB on the CPU: refused at the defaults
    (1066.8 MB), it runs with pieces of 1 Mi elements (4 MiB requests) at depth 1."""
    args = ModelArgs(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000, ffn_dim=2048
    )
    assert args.param_count() == 134_105_856 and not args.tie_embeddings
    engine = Engine(models.build(args, device="meta"), wide_config(tmp_path, host_budget="512MiB"))
    assert (engine.config.streaming.piece_numel, engine.config.streaming.prefetch_depth) == (
        1 << 20,
        1,
    )
    assert engine.parts.sizing.current.needs()[Tier.HOST] <= 512 << 20
    with pytest.raises(
        ConfigError, match=r"need at least 1066\.8 MB of host memory with pieces of 16 Mi"
    ):
        Engine(
            models.build(args, device="meta"),
            wide_config(tmp_path, host_budget="512MiB", piece_numel=16 << 20, prefetch_depth=2),
        )


def test_a_resume_keeps_the_piece_size_its_checkpoint_was_written_with(tmp_path) -> None:
    """Shards are keyed by their pieces: a resume under a budget that would choose larger ones
    reads the checkpoint back with its own (the manifest records it)."""
    from tests.support.cli import train
    from tierzero.checkpoint.catalog import newest_checkpoint

    run_dir = str(tmp_path / "run")
    first = train(
        "--offload",
        "nvme",
        "--dtype",
        "fp32",
        "--host-budget",
        "40MiB",
        "--steps",
        "1",
        "--run-dir",
        run_dir,
    )
    assert first.exit_code == 0, first.output
    written = newest_checkpoint(run_dir)[1].engine["piece_numel"]
    assert written < 16 << 20
    resumed = train("--resume", "--host-budget", "400MiB", "--steps", "2", "--run-dir", run_dir)
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from checkpoint step 1" in resumed.output
    assert newest_checkpoint(run_dir)[1].engine["piece_numel"] == written
