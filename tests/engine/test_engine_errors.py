"""Bad input to the engine: one clear error before training starts, nothing written."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
import torch
from torch import nn

from tests.support.engine import SMALL
from tierzero import Config, models
from tierzero.engine import Engine
from tierzero.errors import ConfigError


def nvme_config(tmp_path, **kw) -> Config:
    # an existing directory, which a refused engine leaves empty
    (tmp_path / "nvme").mkdir(exist_ok=True)
    return Config(offload="nvme", nvme_path=[str(tmp_path / "nvme")], **kw)


def test_host_budget_too_small_for_one_unit(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"host budget .* too small.*--host-budget"):
        Engine(models.build(SMALL, device="meta"), nvme_config(tmp_path, host_budget="64KiB"))
    assert not any((tmp_path / "nvme").iterdir())


def test_gpu_budget_too_small_for_one_unit(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"gpu budget .* too small.*--gpu-budget"):
        Engine(models.build(SMALL, device="meta"), nvme_config(tmp_path, gpu_budget="16KiB"))


def test_missing_nvme_path_is_made_at_open(tmp_path) -> None:
    """As the CLI makes its default RUN_DIR/nvme; nothing is written before `open()`."""
    path = tmp_path / "no" / "such" / "dir"
    engine = Engine(
        models.build(SMALL, device="meta"), Config(offload="nvme", nvme_path=[str(path)])
    )
    assert not (tmp_path / "no").exists()
    with engine:
        engine.open()
        assert path.is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="file is not a directory"):
        Engine(
            models.build(SMALL, device="meta"),
            Config(offload="nvme", nvme_path=[str(tmp_path / "file" / "x")]),
        )


def test_unwritable_nvme_path() -> None:
    # /proc refuses new dirs, even to root
    cfg = Config(offload="nvme", nvme_path=["/proc/tierzero-nvme"])
    with pytest.raises(ConfigError, match="not writable"):
        Engine(models.build(SMALL, device="meta"), cfg)


def test_full_disk(tmp_path, monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(ConfigError, match=r"GB free .* needs"):
        Engine(models.build(SMALL, device="meta"), nvme_config(tmp_path))
    assert not any((tmp_path / "nvme").iterdir())


def test_model_without_repeated_blocks(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="no nn.ModuleList of repeated blocks"):
        Engine(model, nvme_config(tmp_path))


def test_named_units_must_exist(tmp_path) -> None:
    with pytest.raises(ConfigError, match="units 'layers' is not"):
        Engine(models.build(SMALL, device="meta"), nvme_config(tmp_path, units="layers"))


def test_model_calling_blocks_out_of_order_is_refused(tmp_path) -> None:
    model = models.build(SMALL, device="meta")
    original = model.forward

    def shuffled(idx, targets=None):
        model.blocks = nn.ModuleList([model.blocks[1], model.blocks[0], model.blocks[2]])
        return original(idx, targets)

    with Engine(model, nvme_config(tmp_path)) as engine:
        model.forward = shuffled
        x = torch.zeros(1, 8, dtype=torch.long)
        with pytest.raises(RuntimeError, match="must call its blocks"):
            engine.train_step((x, x))
        # the failed pass released everything
        assert engine.parts.tiers.device_pool.leased_bytes == 0
