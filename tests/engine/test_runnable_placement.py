"""Placements the engine cannot run are refused at construction, in one sentence naming the fix:
grads on NVMe with the optimizer stepping on the GPU would be read from NVMe
into device memory, which the NVMe store refuses, at the first step."""

from __future__ import annotations

import pytest

from tests.support.engine import SMALL
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.errors import ConfigError


def test_grads_on_nvme_with_the_optimizer_on_the_gpu_are_refused_naming_the_fix(tmp_path) -> None:
    cfg = Config(
        placement=Placement(Tier.GPU, Tier.NVME, Tier.GPU, Tier.GPU, Tier.GPU),
        nvme_path=[str(tmp_path / "nvme")],
        host_budget="256MiB",
        gpu_budget="256MiB",
    )
    with pytest.raises(
        ConfigError, match=r"grad=nvme.*home grads on host .* or move master and moments off"
    ):
        Engine(models.build(SMALL, device="meta", seed=0), cfg)
    assert not (tmp_path / "nvme").exists()  # refused before anything was written


def test_grads_on_nvme_with_the_optimizer_on_the_host_run(tmp_path) -> None:
    cfg = Config(
        placement=Placement(Tier.GPU, Tier.NVME, Tier.HOST, Tier.HOST, Tier.HOST),
        nvme_path=[str(tmp_path / "nvme")],
        host_budget="256MiB",
        gpu_budget="256MiB",
    )
    Engine(models.build(SMALL, device="meta", seed=0), cfg).close()
