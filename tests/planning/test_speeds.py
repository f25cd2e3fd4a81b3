"""`tierzero bench`'s CPU AdamW figure (`tierzero.planning.speeds`) is measured on what the
engine steps -- one piece, whose state does not fit in a CPU cache -- not on a few million
elements that sit in the last-level cache and run several times faster than any real step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierzero.config import PIECE_NUMEL
from tierzero.planning import speeds


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache sysfs reports (Linux), or None."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=None)


def test_adam_is_timed_on_one_piece_of_state_beyond_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    timed = []

    def once(op, seconds, sync) -> float:  # what the fused step would run on, not run
        [group] = op.__self__.param_groups
        timed.append([(p.numel(), p.grad.numel()) for p in group["params"]])
        return 1.0

    monkeypatch.setattr(speeds, "_best_seconds", once)
    assert speeds.adam_params_per_s(seconds=0.01) == PIECE_NUMEL  # params per (fake) second
    assert timed == [[(PIECE_NUMEL, PIECE_NUMEL)]]
    state_bytes = 4 * 4 * PIECE_NUMEL  # fp32 param, grad, exp_avg, exp_avg_sq
    assert state_bytes >= 256 << 20
    cache = last_level_cache_bytes()
    assert cache is None or state_bytes > 4 * cache
