"""`Config` and `RunConfig` in sections: built from the flat keys users and TOML files write,
each key landing in its one section; frozen; changed only through `replace`, which checks the
copy like a new config; a run's config.toml reads back to an equal config."""

from __future__ import annotations

import dataclasses

import pytest

from tierzero.config import (
    Config,
    Execution,
    OptimizerSettings,
    RunConfig,
    StateFormat,
    Tiering,
)
from tierzero.configfile import load_run_config, to_toml
from tierzero.errors import ConfigError


def test_each_flat_key_lands_in_one_section() -> None:
    keys = [name for section in Config.SECTIONS.values() for name in _names(section)]
    assert len(keys) == len(set(keys))  # no key in two sections
    assert Config.keys() == set(keys) | {"seed"}
    c = Config(lr=3e-4, offload="host", accumulate=4, optimizer_state="int8", seed=7)
    assert c.optimizer.lr == 3e-4 and c.tiering.offload.value == "host"
    assert c.execution.accumulate == 4 and c.formats.optimizer_state is StateFormat.INT8
    assert c.seed == 7 and c.flat()["lr"] == 3e-4


def test_a_whole_section_or_its_keys_but_not_both() -> None:
    c = Config(optimizer=OptimizerSettings(lr=0.5), execution=Execution(accumulate=2))
    assert c.optimizer.lr == 0.5 and c.execution.accumulate == 2
    with pytest.raises(TypeError, match="given twice"):
        Config(lr=0.1, optimizer=OptimizerSettings())
    with pytest.raises(TypeError, match="unknown keys"):
        Config(learning_rate=0.1)


def test_sections_are_frozen_and_replace_checks_the_copy() -> None:
    c = Config(lr=1e-3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.optimizer.lr = 2.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.seed = 2  # type: ignore[misc]
    d = c.replace(lr=2e-3, nvme_path="elsewhere")
    assert (c.optimizer.lr, d.optimizer.lr) == (1e-3, 2e-3)
    assert d.tiering.nvme_path == ["elsewhere"] and c.tiering.nvme_path == ["tierzero-nvme"]
    assert d.execution is c.execution  # untouched sections are shared, not copied
    with pytest.raises(ConfigError, match="lr must be a finite number > 0"):
        c.replace(lr=-1.0)
    with pytest.raises(TypeError, match="no keys"):
        c.replace(learning_rate=1.0)


def test_a_run_config_routes_engine_keys_to_its_engine() -> None:
    run = RunConfig(steps=3, lora_r=4, engine=Config(offload="nvme"))
    changed = run.replace(steps=5, lr=0.25, eval_every=0)
    assert changed.steps == 5 and changed.engine.optimizer.lr == 0.25
    assert changed.evaluation.eval_every == 0 and changed.lora.lora_r == 4
    assert run.steps == 3 and run.engine.optimizer.lr == Config().optimizer.lr
    flat = changed.flat()
    assert flat["lr"] == 0.25 and flat["lora_r"] == 4 and "engine" not in flat


def test_config_toml_reads_back_equal(tmp_path) -> None:
    run = load_run_config(None, {"lr": 3e-4, "accumulate": 2, "lora_r": 8, "offload": "host"})
    (tmp_path / "config.toml").write_text(to_toml(run))
    back = load_run_config(tmp_path / "config.toml")
    assert back == run and to_toml(back) == to_toml(run)
    assert isinstance(back.engine.tiering, Tiering)


def _names(section: type) -> list[str]:
    return [f.name for f in dataclasses.fields(section)]
