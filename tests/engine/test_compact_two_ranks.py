"""Compact state on two ranks (gloo, two CPU processes): each rank quantises and rounds its own
pieces, a checkpoint of both resumes bitwise -- the resumed run stepping on the compute device
by choice (`optimizer_device="gpu"`: each rank's pieces brought up and put back down), the
straight run on the host -- and the weights stay near the fp32 reference. Weights travel back
to the test through safetensors, never pickle."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from tests.support.engine import SMALL, batches, reference_run
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine

STEPS = 3


def _config(root: str, name: str, side: str = "cpu") -> Config:
    return Config(
        placement=Placement(Tier.NVME, Tier.HOST, Tier.NVME, Tier.NVME, Tier.NVME),
        nvme_path=[f"{root}/{name}"],
        lr=3e-3,
        total_steps=STEPS,
        piece_numel=8192,
        optimizer_state="int8",
        master="bf16",
        optimizer_device=side,
    )


def _train(engine: Engine, rank: int, steps: list) -> None:
    for x, y in steps:
        engine.train_step((x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))


def _rank(rank: int, root: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2
    )
    try:
        data = batches()
        steps = [data.next_batch() for _ in range(STEPS)]
        with Engine(models.build(SMALL, device="meta", seed=0), _config(root, "a")) as engine:
            _train(engine, rank, steps[:2])
            engine.save_checkpoint(f"{root}/run")
            _train(engine, rank, steps[2:])
            straight = engine.master_state_dict()  # a collective: every rank gathers
        resuming = _config(root, "b", side="gpu")
        with Engine(models.build(SMALL, device="meta", seed=0), resuming) as engine:
            assert engine.parts.step_reason == "on the compute device (--optimizer-device gpu)"
            engine.load_checkpoint(f"{root}/run")
            _train(engine, rank, steps[2:])
            resumed = engine.master_state_dict()
        if rank == 0:
            for name, weights in (("straight", straight), ("resumed", resumed)):
                save_file(
                    {k: v.contiguous() for k, v in weights.items() if k != "head.weight"},
                    f"{root}/{name}.safetensors",
                )
    finally:
        dist.destroy_process_group()


def test_two_ranks_of_compact_state_resume_bitwise_and_track_the_reference(tmp_path) -> None:
    mp.spawn(_rank, args=(str(tmp_path),), nprocs=2, join=True)
    straight = load_file(str(tmp_path / "straight.safetensors"))
    resumed = load_file(str(tmp_path / "resumed.safetensors"))
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    _, ref = reference_run(SMALL, Config(offload="none", lr=3e-3, total_steps=STEPS), steps=STEPS)
    # bf16 weights and int8 moments: Adam moves a weight by about lr per step whatever its
    # moments' rounding, so the compact run stays within 2 x steps x lr of fp32's, plus a bf16 ulp
    for key, value in straight.items():
        torch.testing.assert_close(value, ref[key], rtol=2**-8, atol=2 * STEPS * 3e-3)
    assert any(not torch.equal(v, ref[k]) for k, v in straight.items())  # compact, not fp32
