"""`Config` and `RunConfig` refuse every NaN or infinite number in one sentence naming its key
(`ConfigError.key`), whether it came from Python or a TOML file: a NaN weight decay trained to
a NaN loss, an infinite eps froze every weight, an infinite loss scale crashed on `int(inf)`."""

from __future__ import annotations

import math

import pytest

from tierzero.config import Config, Evaluation, RunConfig
from tierzero.configfile import load_run_config
from tierzero.errors import ConfigError

NUMBERS = [
    "lr",
    "eps",
    "weight_decay",
    "warmup_steps",
    "total_steps",
    "clip_grad_norm",
    "min_lr_ratio",
    "loss_scale",
    "loss_scale_window",
    "accumulate",
    "prefetch_depth",
    "host_budget",
]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", NUMBERS)
def test_non_finite_engine_numbers_are_refused(key: str, value: float) -> None:
    with pytest.raises(ConfigError) as refused:
        Config(**{key: value})
    assert refused.value.key == key and str(refused.value).startswith(f"{key} ")


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_betas_and_lora_numbers_are_refused(value: float) -> None:
    for beta in ((0.9, value), (value, 0.95)):
        with pytest.raises(ConfigError, match=r"^betas must be two numbers in \[0, 1\)"):
            Config(betas=beta)
    for key in ("lora_alpha", "lora_dropout"):
        with pytest.raises(ConfigError, match=f"^{key} must be") as refused:
            RunConfig(**{key: value})
        assert refused.value.key == key


def test_toml_infinities_are_refused_by_their_key(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("weight_decay = nan\n")
    with pytest.raises(ConfigError, match="^weight_decay must be a finite number >= 0, got nan"):
        load_run_config(path)
    path.write_text("loss_scale = inf\n")
    with pytest.raises(
        ConfigError, match=r"^loss_scale must be a power of two \(like 65536\), got inf"
    ):
        load_run_config(path)


def test_steps_that_set_the_schedule_are_refused_as_steps() -> None:
    """`total_steps` follows `steps` when not given: a bad `steps` is refused by its own name."""
    with pytest.raises(ConfigError, match="^steps must be an integer >= 1, got 0") as refused:
        load_run_config(overrides={"steps": 0})
    assert refused.value.key == "steps"
    with pytest.raises(ConfigError, match="^total_steps must be a finite number > 0, got 0"):
        load_run_config(overrides={"steps": 5, "total_steps": 0})


def test_a_config_written_before_eval_tokens_still_loads(tmp_path) -> None:
    """A run's config.toml from before the validation set was fixed in tokens holds
    `eval_batches`; a resume reads it (the key is retired, not unknown)."""
    path = tmp_path / "config.toml"
    path.write_text('model = "tiny"\nsteps = 3\neval_batches = 4\n')
    run = load_run_config(path)
    assert run.steps == 3 and run.evaluation.eval_tokens == Evaluation.eval_tokens
