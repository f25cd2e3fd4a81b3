"""The run's config as a flat TOML file: read it, apply the CLI's flags, write the resolved one.

Run keys (`RunConfig`) and engine keys (`Config`) sit side by side in one table, so a run
directory's `config.toml` is also a valid `--config` file.
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Any

from tierzero.config import Config, Placement, RunConfig, StateKind
from tierzero.errors import ConfigError
from tierzero.refusals import count

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


_RUN_FIELDS = RunConfig.keys() - {"engine"}
_ENGINE_FIELDS = Config.keys()


# keys older config.toml files hold whose meaning a newer key took over: read and ignored
_RETIRED = {"eval_batches"}  # the validation set is fixed in tokens now (`eval_tokens`)


def load_run_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> RunConfig:
    """Read a flat TOML file (run and engine keys side by side), then apply `overrides`.

    Overrides are the CLI flags that were given; `None` values mean "not given".
    """
    values = read_toml(path) if path is not None else {}
    for key in _RETIRED:  # a run's config.toml written before the key was retired still resumes
        values.pop(key, None)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = set(values) - _RUN_FIELDS - _ENGINE_FIELDS
    if unknown:
        raise ConfigError(
            f"unknown config keys {sorted(unknown)}; valid keys are "
            f"{', '.join(sorted(_RUN_FIELDS | _ENGINE_FIELDS))}"
        )
    engine_values = {k: v for k, v in values.items() if k in _ENGINE_FIELDS}
    run_values = {k: v for k, v in values.items() if k in _RUN_FIELDS}
    if (
        "total_steps" not in engine_values
    ):  # the schedule follows the run's length: refuse a bad one as `steps`
        engine_values["total_steps"] = count(run_values.get("steps", RunConfig.steps), "steps")
    try:
        engine = Config(**engine_values)
        return RunConfig(**run_values, engine=engine)
    except TypeError as e:
        raise ConfigError(
            f"config has a value of the wrong type ({e}); check the TOML types"
        ) from None


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist; check the --config path")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(
            f"config file '{p}' is not valid TOML ({e}); fix the line it names"
        ) from None


def to_toml(run: RunConfig) -> str:
    """The resolved config as flat TOML, readable back by `load_run_config`."""
    lines = []
    for key, value in sorted(run.flat().items()):
        if value is None:
            continue
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f'"{value.value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Placement):
        return "{ " + ", ".join(f'{k.value} = "{value.home(k).value}"' for k in StateKind) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
