"""One `Workload`: built from the engine's partition of a model, or from a preset's
shape without building one, it is the same units and the same memory model."""

from __future__ import annotations

import pytest

from tierzero import models
from tierzero.config import Offload, Placement, Tier
from tierzero.errors import ConfigError
from tierzero.layout.partition import partition
from tierzero.models.presets import PRESETS
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.placement import candidate_placements
from tierzero.planning.workload import Workload, steps_on_gpu


def layout(work: Workload) -> list[tuple]:
    return [
        (
            u.index,
            u.name,
            u.kind,
            u.numel,
            u.padded_numel,
            u.trainable_numel,
            u.uses_with,
            u.world_size,
        )
        for u in work.units
    ]


@pytest.mark.parametrize("preset, world_size", [("tiny", 1), ("tiny", 3), ("125m", 2)])
def test_a_preset_and_its_built_model_are_one_workload(preset: str, world_size: int) -> None:
    built = Workload.from_units(
        partition(models.build(preset, device="meta"), world_size), 2, device="cpu"
    )
    shaped = Workload.from_preset(PRESETS[preset], 2, world_size=world_size, device="cpu")
    assert built.world_size == world_size
    assert layout(built) == layout(shaped)
    assert built.tied_embeddings == shaped.tied_embeddings == PRESETS[preset].tie_embeddings
    for placement in (
        Placement(),
        Placement(*[Tier.NVME] * 5),
        Placement.for_offload(Offload.HOST),
    ):
        assert peak_memory(built, placement) == peak_memory(shaped, placement)


def test_sizes_name_the_ends_and_everything_else_is_a_block() -> None:
    work = Workload.from_sizes([("embedding", 10), ("b", 20), ("head", 5)], 2, tied_embeddings=True)
    assert [u.kind for u in work.units] == ["embedding", "block", "head"]
    assert work.units[-1].uses_with == (0,) and work.tied_embeddings
    rooted = Workload.from_sizes([("root", 10), ("b", 20)], 2)
    assert [u.kind for u in rooted.units] == ["root", "block"]
    assert [u.kind for u in Workload.from_sizes([("a", 1), ("head", 1), ("z", 1)], 2).units] == [
        "block"
    ] * 3


def test_frozen_units_have_no_optimizer_state() -> None:
    work = Workload.from_sizes([("embedding", 4096), ("b", 4096)], 2, trainable=[0, 2048])
    assert work.state_shard_numel == 2048 and work.shard_numel == 8192
    # every param is stored (bf16); grad, master and both moments (fp32) for the trainable only
    assert (
        peak_memory(work, Placement(*[Tier.NVME] * 5)).tiers[Tier.NVME].homes_bytes
        == 8192 * 2 + 2048 * 16
    )


def test_bad_workloads_are_refused_in_one_sentence() -> None:
    with pytest.raises(ConfigError, match="at least one unit"):
        Workload.from_sizes([("a", 0)], 2)
    with pytest.raises(ConfigError, match="GPUs"):
        Workload.from_sizes([("a", 1)], 2, world_size=0)
    with pytest.raises(ConfigError, match="prefetch_depth"):
        Workload.from_sizes([("a", 1)], 2, prefetch_depth=-1)


def test_the_optimizer_steps_on_the_gpu_only_with_every_state_there() -> None:
    on_gpu = [p for p in candidate_placements() if steps_on_gpu(p)]
    assert on_gpu == [Placement()]
    assert steps_on_gpu(Placement(Tier.NVME, Tier.HOST, Tier.GPU, Tier.GPU, Tier.GPU))
