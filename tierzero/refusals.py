"""How a config value is checked and refused: one sentence naming the key, tagged with it.

`tierzero.config` validates every field of `Config` and `RunConfig` with these; a refusal carries
the key so the CLI can name the flag the user gave instead (`--steps`, not `total_steps`).
"""

from __future__ import annotations

import math
from typing import Any

from tierzero.errors import ConfigError


def number(value: Any) -> bool:
    """A finite int or float (not a bool): NaN and infinities are refused wherever a number is."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def whole(value: Any) -> bool:
    return number(value) and int(value) == value


def positive(value: float, name: str, strict: bool = False) -> None:
    """A finite number >= 0 (`strict`: > 0)."""
    if not number(value) or value < 0 or (strict and value == 0):
        need = "> 0" if strict else ">= 0"
        raise refused(name, f"must be a finite number {need}, got {value!r}")


def count(value: Any, name: str) -> int:
    """An integer >= 1 (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise refused(name, f"must be an integer >= 1, got {value!r}")
    return value


def refused(key: str, problem: str) -> ConfigError:
    """The refusal of one key's value: `key problem`, tagged with the key (the CLI names its
    flag)."""
    return ConfigError(f"{key} {problem}", key=key)
