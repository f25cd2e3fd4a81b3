"""The placement planner and its step-time model, counted by hand: what each candidate holds
and moves, which one is chosen, and a bench profile's predictions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierzero.config import Offload, Placement, StateKind, Tier
from tierzero.errors import ConfigError
from tierzero.models.presets import PRESETS
from tierzero.planning.ledger import (
    GB,
    units_from_args,
)
from tierzero.planning.placement import (
    Link,
    PlacementChoice,
    PlacementEstimate,
    candidate_placements,
    choose_placement,
    estimate,
    load_profile,
)
from tierzero.planning.workload import Workload

SEVEN_B = units_from_args(PRESETS["7b"])
PROFILE = {
    "nvme": {"read_gbps": 3.0, "write_gbps": 2.0},
    "adam": {"params_per_s": 1e9},
    "compute": {"fp32_tflops": 20.0, "bf16_tflops": 100.0},
    "h2d": {"pinned_gbps": 20.0, "pageable_gbps": 8.0},
}


def write_profile(tmp_path: Path, profile: dict, name: str = "profile.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(profile))
    return path


def test_candidates_include_the_offload_presets() -> None:
    candidates = candidate_placements()
    assert candidates[0] == Placement()
    assert len(candidates) == 13 and len(set(candidates)) == 13
    assert Placement.for_offload(Offload.HOST) in candidates
    assert Placement.for_offload(Offload.NVME) in candidates


def test_all_nvme_by_hand() -> None:
    """Two blocks of 100 and 300 params (each padded to 2048, one piece), one rank, bf16,
    prefetch 1, no overlap: every byte counted (the parts are `tierzero.planning.phases`')."""
    work = Workload.from_sizes(
        (("a", 100), ("b", 300)),
        compute_itemsize=2,
        grad_itemsize=2,
        prefetch_depth=1,
        overlap=False,
    )
    e = estimate(Placement(*[Tier.NVME] * 5), work)
    shard = 2048
    # bf16 params and grads, fp32 optimizer
    assert e.resident_bytes[Tier.NVME] == 2 * shard * (2 + 2 + 3 * 4)
    # both param shards in flight (prefetch 1), then b's grads: 300 bf16 + its flat fp32 grad
    # and a piece of it rounded to bf16
    assert e.resident_bytes[Tier.GPU] == 2 * shard * 2 + (300 * 2 + shard * 4 + shard * 2)
    # the optimizer: 1 piece read ahead + 1 writing, a bf16 grad and 3 fp32 states each, one new
    # param piece, and the grad piece being stepped upcast to fp32
    assert e.resident_bytes[Tier.HOST] == 2 * shard * (2 + 3 * 4) + shard * 2 + shard * 4
    assert e.moved_bytes == {
        Link.NVME_TO_HOST: 2 * 400 * 2
        + 400 * 2
        + 400 * 12,  # params twice, grads, optimizer states
        Link.HOST_TO_NVME: 400 * 2 + 400 * 12 + 400 * 2,  # grads, optimizer states, new params
        Link.HOST_TO_GPU: 2 * 400 * 2,
        Link.GPU_TO_HOST: 400 * 2,
    }


def test_two_ranks_split_states_and_share_the_machine() -> None:
    work = Workload.from_sizes(
        (("a", 101),),
        compute_itemsize=2,
        grad_itemsize=2,
        world_size=2,
        prefetch_depth=0,
        overlap=False,
    )
    e = estimate(Placement.for_offload(Offload.HOST), work)
    shard = 2048  # 101 padded to two aligned shards
    # both ranks' bf16 grads and fp32 optimizer states, each one's new bf16 params on their way
    # up (in a block of the fp32 pieces' size class) and its grad piece being stepped, in fp32
    assert e.resident_bytes[Tier.HOST] == 2 * shard * 14 + 2 * shard * 2 + 2 * shard * 4
    # param shard, gathered params, then 101 bf16 grads, the flat fp32 grad and its reduced
    # shard, a piece of which is rounded to bf16
    unit_grads = 101 * 2 + 2 * shard * 4 + shard * 4 + shard * 2
    assert e.resident_bytes[Tier.GPU] == shard * 2 + 2 * shard * 2 + unit_grads
    assert e.moved_bytes[Link.GPU_TO_HOST] == 51 * 2
    assert e.moved_bytes[Link.HOST_TO_GPU] == 51 * 2


def choose_7b(**budgets: int | None) -> PlacementChoice:
    return choose_placement(
        Workload.from_sizes(SEVEN_B, 2, grad_itemsize=2),
        **{"gpu_budget": None, "host_budget": None, "nvme_free": None, **budgets},
    )


def test_ample_budgets_choose_all_gpu() -> None:
    choice = choose_7b(gpu_budget=200 * GB, host_budget=1000 * GB, nvme_free=10_000 * GB)
    assert choice.fits and choice.placement == Placement()
    assert choice.shortfall is None
    assert sum(choice.moved_bytes.values()) == 0


def test_small_gpu_pushes_params_off_the_gpu() -> None:
    choice = choose_7b(gpu_budget=8 * GB, host_budget=1000 * GB)
    assert choice.fits
    assert choice.placement.param is not Tier.GPU
    assert choice.resident_bytes[Tier.GPU] <= 8 * GB


def test_small_host_pushes_the_optimizer_to_nvme() -> None:
    choice = choose_7b(gpu_budget=24 * GB, host_budget=32 * GB, nvme_free=1000 * GB)
    assert choice.fits
    assert all(
        choice.placement.home(k) is Tier.NVME
        for k in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    )
    assert choice.resident_bytes[Tier.HOST] <= 32 * GB


def test_impossible_budgets_name_the_tiers_and_the_missing_bytes() -> None:
    """107.8 GB of state against 24 + 32 + 10 GB: the nearest miss, and each short tier's bytes."""
    budgets = {Tier.GPU: 24 * GB, Tier.HOST: 32 * GB, Tier.NVME: 10 * GB}
    choice = choose_7b(gpu_budget=24 * GB, host_budget=32 * GB, nvme_free=10 * GB)
    assert not choice.fits
    assert choice.shortfall_bytes
    for tier, missing in choice.shortfall_bytes.items():
        assert missing == choice.resident_bytes[tier] - budgets[tier] > 0
        assert f"{missing / GB:.2f} GB more" in choice.shortfall
    work = Workload.from_sizes(SEVEN_B, 2, grad_itemsize=2)
    fewest = min(
        sum(estimate(p, work).overflow_bytes(budgets).values()) for p in candidate_placements()
    )
    assert sum(choice.shortfall_bytes.values()) == fewest
    assert "\n" not in choice.shortfall


def test_gpu_too_small_for_one_unit_is_a_gpu_shortfall() -> None:
    choice = choose_7b(gpu_budget=1 * GB)
    assert not choice.fits and set(choice.shortfall_bytes) == {Tier.GPU}
    assert "gpu memory" in choice.shortfall and "prefetch depth" in choice.shortfall


def test_profile_predicts_step_time_monotone_in_bandwidth(tmp_path: Path) -> None:
    times = []
    for gbps in (1.0, 2.0, 4.0, 8.0):
        prof = dict(PROFILE, nvme={"read_gbps": gbps, "write_gbps": gbps})
        profile = load_profile(write_profile(tmp_path, prof))
        work = Workload.from_sizes(SEVEN_B, 2, grad_itemsize=2, tokens_per_step=4096)
        times.append(estimate(Placement(*[Tier.NVME] * 5), work, profile).predicted_step_s)
    assert all(t is not None for t in times)
    assert times == sorted(times, reverse=True) and times[0] > times[-1]


def test_step_time_by_hand(tmp_path: Path) -> None:
    """All on host, one unit: I/O-bound forward/backward, then Adam-bound optimizer."""
    profile = load_profile(write_profile(tmp_path, PROFILE))
    work = Workload.from_sizes((("u", 10**9),), 2, grad_itemsize=2, tokens_per_step=1000)
    e = estimate(Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST), work, profile)
    compute = 8 * 10**9 * 1000 / 100e12
    pcie = (2 * 2e9 + 2e9) / 20e9  # params in twice, grads out once
    adam = 10**9 / 1e9
    assert e.predicted_step_s == pytest.approx(max(compute, pcie) + adam)


def test_choice_minimises_step_time_with_a_profile_and_nvme_traffic_without(tmp_path: Path) -> None:
    budgets = {Tier.GPU: 24 * GB, Tier.HOST: 90 * GB, Tier.NVME: 1000 * GB}
    kwargs = dict(gpu_budget=24 * GB, host_budget=90 * GB, nvme_free=1000 * GB)
    profile = load_profile(
        write_profile(tmp_path, dict(PROFILE, h2d={"pinned_gbps": 0.5, "pageable_gbps": 0.1}))
    )
    work = Workload.from_sizes(SEVEN_B, 2, grad_itemsize=2, tokens_per_step=4096)
    fitting = [
        e
        for e in (estimate(p, work, profile) for p in candidate_placements())
        if not e.overflow_bytes(budgets)
    ]
    assert len(fitting) > 1
    timed = choose_placement(work, profile=profile, **kwargs)
    assert timed.predicted_step_s == min(e.predicted_step_s for e in fitting)
    untimed = choose_placement(work, **kwargs)
    assert untimed.predicted_step_s is None
    assert nvme_bytes(untimed) == min(nvme_bytes(e) for e in fitting)


def nvme_bytes(e: PlacementEstimate | PlacementChoice) -> int:
    return e.moved_bytes[Link.NVME_TO_HOST] + e.moved_bytes[Link.HOST_TO_NVME]


def test_cpu_only_profile_makes_pcie_free(tmp_path: Path) -> None:
    profile = load_profile(write_profile(tmp_path, dict(PROFILE, h2d=None)))
    assert profile.h2d_pinned_gbps is None
    work = Workload.from_sizes((("u", 10**6),), 4, grad_itemsize=4, tokens_per_step=0)
    e = estimate(Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST), work, profile)
    assert e.predicted_step_s == pytest.approx(10**6 / 1e9)  # Adam only


def test_load_profile_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="malformed"):
        load_profile(write_profile(tmp_path, {"nvme": {"read_gbps": 1.0}}))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="malformed"):
        load_profile(bad)
    with pytest.raises(ConfigError, match="positive"):
        load_profile(write_profile(tmp_path, dict(PROFILE, adam={"params_per_s": 0})))


def test_frozen_parameters_move_as_params_only() -> None:
    """With a unit's trainable prefix given, grads, optimizer states and the stepped params move
    for it alone; params still move whole for compute."""
    units = (("embedding", 8192), ("blocks.0", 8192), ("head", 8192))
    nvme = Placement(*[Tier.NVME] * 5)
    dense = estimate(nvme, Workload.from_sizes(units, 2, grad_itemsize=4, prefetch_depth=1))
    lora = estimate(
        nvme,
        Workload.from_sizes(units, 2, grad_itemsize=4, prefetch_depth=1, trainable=(0, 2048, 0)),
    )
    params = 3 * 8192 * 2
    # every param is read twice (forward, backward); the trainable ones' grads are written, and
    # the optimizer reads grad, master and both moments (fp32) and writes those three and the param
    assert lora.moved_bytes[Link.NVME_TO_HOST] == 2 * params + 2048 * 4 * 4
    assert lora.moved_bytes[Link.HOST_TO_NVME] == 2048 * 4 + 2048 * 4 * 3 + 2048 * 2
    assert dense.moved_bytes[Link.NVME_TO_HOST] == 2 * params + 3 * 8192 * 4 * 4
    assert lora.memory.tiers[Tier.NVME].homes_bytes == params + 2048 * 16
