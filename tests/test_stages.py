"""ZeRO stages 1, 2 and 3 on two ranks (gloo, two CPU processes), in process, against the
full-batch reference, with the collectives counted.

One spawn runs all three stages back to back on `accumulate` 2 (so stage 1's once-per-step
reduction differs from stage 2's per micro-batch one), with grads and params homed in host
memory, states on nvme. Each rank counts its reduce-scatters and all-gathers by wrapping
`Comm`. Stated tolerance: 5e-5 against the reference after three AdamW steps, as in
test_engine_two_ranks (a different summation order, through Adam's 1/sqrt(v)).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from tierzero import Config, Placement, Tier, models
from tierzero.comm import Comm
from tierzero.engine import Engine
from tierzero.errors import ConfigError
from tierzero.partition import grad_uses, partition

from engine_helpers import SMALL, batches, reference_run

STEPS, ACCUMULATE = 3, 2
STAGES = (1, 2, 3)


def _rank(rank: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2)
    counts: dict[str, int] = {}

    def counting(name: str):
        method = getattr(Comm, name)

        def run(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return method(self, *args, **kwargs)
        return run

    Comm.reduce_scatter_async = counting("reduce_scatter_async")
    Comm.all_gather_async = counting("all_gather_async")
    report = {}
    try:
        for stage in STAGES:
            counts.clear()
            cfg = Config(placement=Placement(Tier.HOST, Tier.HOST, Tier.NVME, Tier.NVME, Tier.NVME),
                         nvme_path=[f"{root}/nvme{stage}"], lr=3e-3, total_steps=STEPS, accumulate=ACCUMULATE,
                         stage=stage)
            data = batches()
            with Engine(models.build(SMALL, device="meta", seed=0), cfg) as engine:
                for _ in range(STEPS * ACCUMULATE):
                    x, y = data.next_batch()
                    engine.train_step((x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
                report[stage] = {"counts": dict(counts), "stage": engine.stage}
                weights = engine.master_state_dict()  # a collective: every rank gathers
            if rank == 0:
                save_file({k: v.contiguous() for k, v in weights.items() if k != "head.weight"},
                          f"{root}/stage{stage}.safetensors")
        if rank == 0:
            with open(f"{root}/report.json", "w") as f:
                json.dump(report, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    mp.spawn(_rank, args=(str(root),), nprocs=2, join=True)
    report = json.loads((root / "report.json").read_text())
    return {s: (load_file(str(root / f"stage{s}.safetensors")), report[str(s)]) for s in STAGES}


def test_every_stage_matches_the_full_batch_reference(stages) -> None:
    _, ref = reference_run(SMALL, Config(offload="none", lr=3e-3, total_steps=STEPS, accumulate=ACCUMULATE),
                           steps=STEPS)
    for stage, (weights, report) in stages.items():
        assert report["stage"] == stage
        assert weights.keys() == ref.keys() - {"head.weight"}
        for key, value in weights.items():
            torch.testing.assert_close(value, ref[key], rtol=0, atol=5e-5, msg=lambda m: f"stage {stage}: {m}")


def test_collectives_per_stage(stages) -> None:
    """Per step: stage 3 reduce-scatters every unit use's grad per micro-batch and gathers
    every use's params; stage 2 reduces as often but gathers only once per unit, after the
    step; stage 1 reduces once per unit use per step, whatever `accumulate` is."""
    units = partition(models.build(SMALL, device="meta", seed=0), 2)
    reductions = sum(grad_uses(units).values())  # per backward: a tied embedding's two uses count twice
    counts = {s: report["counts"] for s, (_, report) in stages.items()}
    assert counts[1]["reduce_scatter_async"] == STEPS * reductions
    assert counts[2]["reduce_scatter_async"] == STEPS * ACCUMULATE * reductions
    assert counts[3]["reduce_scatter_async"] == STEPS * ACCUMULATE * reductions
    assert counts[1]["all_gather_async"] == counts[2]["all_gather_async"] == STEPS * len(units)
    assert counts[3]["all_gather_async"] > STEPS * ACCUMULATE * len(units)  # every use, forward and backward


def test_a_stage_is_one_two_or_three() -> None:
    with pytest.raises(ConfigError, match="stage must be 1, 2 or 3"):
        Config(stage=4)
