"""ZeRO stages 1, 2 and 3 on two ranks (gloo, two CPU processes), in process, against the
full-batch reference, with the collectives counted.

One spawn runs all three stages back to back on `accumulate` 2 (so stage 1's once-per-step reduction
differs from stage 2's per micro-batch one), with optimizer states on nvme and grads and params in
host memory (stage 1: on nvme too). Each rank counts its reduce-scatters and all-gathers by wrapping
`Comm`. Stated tolerance: 5e-5 against the reference after three AdamW steps, as in
test_engine_two_ranks (a different summation order, through Adam's 1/sqrt(v)). Also: stage 2 resumes
bitwise from a checkpoint, and the engine's automatic choice of stage.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from tests.support.engine import SMALL, batches, reference_run
from tierzero import Config, Placement, Tier, models
from tierzero.distributed.comm import Comm
from tierzero.engine import Engine
from tierzero.errors import CheckpointError, ConfigError
from tierzero.layout.partition import grad_uses, partition
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.swapplan import Op
from tierzero.planning.workload import Workload

STEPS, ACCUMULATE = 2, 2
STAGES = (1, 2, 3)


def _rank(rank: int, root: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2
    )
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
        report["choice"] = _choices(root)
        for stage in STAGES:
            counts.clear()
            # stage 1's whole grads and params on nvme too
            home = Tier.NVME if stage == 1 else Tier.HOST
            cfg = Config(
                placement=Placement(home, home, Tier.NVME, Tier.NVME, Tier.NVME),
                nvme_path=[f"{root}/nvme{stage}"],
                lr=3e-3,
                total_steps=STEPS,
                accumulate=ACCUMULATE,
                stage=stage,
            )
            data = batches()
            with Engine(models.build(SMALL, device="meta", seed=0), cfg) as engine:
                for micro in range(STEPS * ACCUMULATE):
                    if stage == 2 and micro == ACCUMULATE:  # after step 1
                        engine.save_checkpoint(f"{root}/run", data=data.state_dict())
                    x, y = data.next_batch()
                    engine.train_step((x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
                report[stage] = {
                    "counts": dict(counts),
                    "stage": engine.parts.layout.stage,
                    "gathers": sum(op.op is Op.GATHER for op in engine.opened.train_plan.ops),
                }
                weights = engine.master_state_dict()  # a collective: every rank gathers
            if rank == 0:
                save_file(
                    {k: v.contiguous() for k, v in weights.items() if k != "head.weight"},
                    f"{root}/stage{stage}.safetensors",
                )
        _resume(rank, root)
        if rank == 0:
            with open(f"{root}/report.json", "w") as f:
                json.dump(report, f)
    finally:
        dist.destroy_process_group()


def _choices(root: str) -> dict[str, object]:
    """The engine's stage choice (constructors only: nothing is opened) at a generous host
    budget, and at stage 3's own need, where a forced stage 2 is refused."""

    def engine(
        stage: int | None, host_budget: int | None = None, accumulate: int = ACCUMULATE
    ) -> Engine:
        return Engine(
            models.build(SMALL, device="meta", seed=0),
            Config(
                offload="nvme",
                nvme_path=[f"{root}/choice"],
                stage=stage,
                accumulate=accumulate,
                host_budget=host_budget,
            ),
        )

    stage3 = engine(3)
    tight = stage3.parts.sizing.memory(stage3.parts.layout.placement, 3).needs()[Tier.HOST]
    try:
        engine(2, tight)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    return {
        "generous": engine(None, 1 << 30).parts.layout.stage,
        "generous_one_micro": engine(None, 1 << 30, 1).parts.layout.stage,
        "tight": engine(None, tight).parts.layout.stage,
        "refused": refused,
    }


def _resume(rank: int, root: str) -> None:
    """Stage 2 from its step-1 checkpoint to the end (bitwise the uninterrupted run's weights
    are the test's to compare); a stage-3 engine refuses the checkpoint."""

    def config(stage: int, where: str) -> Config:
        return Config(
            placement=Placement(Tier.HOST, Tier.HOST, Tier.NVME, Tier.NVME, Tier.NVME),
            nvme_path=[f"{root}/{where}"],
            lr=3e-3,
            total_steps=STEPS,
            accumulate=ACCUMULATE,
            stage=stage,
        )

    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=0), config(2, "resumed")) as engine:
        data.load_state_dict(engine.load_checkpoint(f"{root}/run").data)
        for _ in range(ACCUMULATE, STEPS * ACCUMULATE):
            x, y = data.next_batch()
            engine.train_step((x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
        weights = engine.master_state_dict()
    if rank == 0:
        save_file(
            {k: v.contiguous() for k, v in weights.items() if k != "head.weight"},
            f"{root}/resumed.safetensors",
        )
    with Engine(models.build(SMALL, device="meta", seed=0), config(3, "refused")) as engine:
        try:
            engine.load_checkpoint(f"{root}/run")
        except CheckpointError as e:
            if rank == 0:
                with open(f"{root}/refused.txt", "w") as f:
                    f.write(str(e))


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    mp.spawn(_rank, args=(str(root),), nprocs=2, join=True)
    report = json.loads((root / "report.json").read_text())
    return {s: (load_file(str(root / f"stage{s}.safetensors")), report[str(s)]) for s in STAGES} | {
        "root": root,
        "choice": report["choice"],
    }


def test_every_stage_matches_the_full_batch_reference(stages) -> None:
    _, ref = reference_run(
        SMALL,
        Config(offload="none", lr=3e-3, total_steps=STEPS, accumulate=ACCUMULATE),
        steps=STEPS,
    )
    for stage, (weights, report) in _runs(stages).items():
        assert report["stage"] == stage
        assert weights.keys() == ref.keys() - {"head.weight"}
        for key, value in weights.items():
            torch.testing.assert_close(
                value, ref[key], rtol=0, atol=5e-5, msg=lambda m, stage=stage: f"stage {stage}: {m}"
            )


def test_collectives_per_stage(stages) -> None:
    """Per step: stage 3 reduce-scatters every unit use's grad per micro-batch and gathers
    every use's params; stage 2 reduces as often but gathers only once per unit, after the
    step; stage 1 reduces once per unit use per step, whatever `accumulate` is."""
    units = partition(models.build(SMALL, device="meta", seed=0), 2)
    # per backward: a tied embedding's two uses count twice
    reductions = sum(grad_uses(units).values())
    counts = {s: report["counts"] for s, (_, report) in _runs(stages).items()}
    assert counts[1]["reduce_scatter_async"] == STEPS * reductions
    assert counts[2]["reduce_scatter_async"] == STEPS * ACCUMULATE * reductions
    assert counts[3]["reduce_scatter_async"] == STEPS * ACCUMULATE * reductions
    assert counts[1]["all_gather_async"] == counts[2]["all_gather_async"] == STEPS * len(units)
    # every use, forward and backward
    assert counts[3]["all_gather_async"] > STEPS * ACCUMULATE * len(units)
    gathers = {s: report["gathers"] for s, (_, report) in _runs(stages).items()}
    assert gathers[1] == gathers[2] == 0 and gathers[3] > 0  # the swap plans' GATHER ops


def test_the_memory_model_counts_replicated_state() -> None:
    """Per rank, two ranks, everything in host memory: stage 2's param home is whole units
    (stage 3's: half), stage 1 with accumulate 2 adds each unit's whole fp32 grad to the grad
    home; with replicated params the pass gathers nothing, and the param sync holds one
    gathered unit and this rank's range."""
    units = [("embedding", 10_000), ("b0", 20_000), ("b1", 20_000), ("head", 5_000)]
    padded = [-(-n // 4096) * 4096 for _, n in units]  # ALIGN_NUMEL x 2 ranks

    def mem(stage: int, accumulate: int = 1):
        return peak_memory(
            Workload.from_sizes(
                units,
                compute_itemsize=2,
                world_size=2,
                device="cuda",
                stage=stage,
                accumulate=accumulate,
                overlap=False,
            ),
            Placement(*[Tier.HOST] * 5),
        ).per_rank()

    s3, s2, s1 = mem(3), mem(2), mem(1, accumulate=2)
    assert s2.tiers[Tier.HOST].homes_bytes - s3.tiers[Tier.HOST].homes_bytes == sum(padded) // 2 * 2
    assert s1.tiers[Tier.HOST].homes_bytes - s2.tiers[Tier.HOST].homes_bytes == sum(padded) * 4
    # one micro-batch: as stage 2
    assert mem(1).tiers[Tier.HOST].homes_bytes == s2.tiers[Tier.HOST].homes_bytes
    assert s3.tiers[Tier.GPU].parts["gathered params"] > 0
    assert (
        s2.tiers[Tier.GPU].parts["params in flight"]
        == s3.tiers[Tier.GPU].parts["params in flight"] * 2
    )
    assert (
        s2.tiers[Tier.GPU].unpooled_phase == "backward"
        and s2.tiers[Tier.GPU].parts["gathered params"] == 0
    )


def test_a_stage_is_one_two_or_three() -> None:
    with pytest.raises(ConfigError, match="stage must be 1, 2 or 3"):
        Config(stage=4)


def test_stage_two_resumes_bitwise_and_refuses_another_stage(stages) -> None:
    resumed = load_file(str(stages["root"] / "resumed.safetensors"))
    uninterrupted = stages[2][0]
    assert resumed.keys() == uninterrupted.keys()
    for key in uninterrupted:
        assert torch.equal(resumed[key], uninterrupted[key]), key
    refused = (stages["root"] / "refused.txt").read_text()
    assert "written at ZeRO stage 2 but this run is at stage 3; resume with --stage 2" in refused


def _runs(stages: dict) -> dict:
    return {s: stages[s] for s in STAGES}


def test_the_engine_chooses_the_stage_by_the_budget(stages) -> None:
    """Replicated state that fits: stage 1 with accumulate > 1, else 2. At stage 3's own need
    (replicated params do not fit): 3, and a forced stage 2 is refused in one sentence."""
    choice = stages["choice"]
    assert (choice["generous"], choice["generous_one_micro"], choice["tight"]) == (1, 2, 3)
    assert choice["refused"].startswith(
        "--stage 2 keeps every unit's params whole on each rank, which needs "
    )
    assert (
        "use --stage 3 (or leave --stage unset to choose), or raise --host-budget"
        in choice["refused"]
    )
