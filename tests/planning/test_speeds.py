"""`tierzero bench`'s CPU AdamW figure (`tierzero.planning.speeds`) is measured on what the
engine steps -- one piece, whose state does not fit in a CPU cache -- not on a few million
elements that sit in the last-level cache and run several times faster than any real step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierzero.config import PIECE_NUMEL
from tierzero.planning import speeds


def test_adam_is_timed_on_one_piece_of_state_beyond_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timed = []

    def once(op, seconds, sync) -> float:  # what the fused step would run on, not run
        [group] = op.__self__.param_groups
        timed.append([(p.numel(), p.grad.numel()) for p in group["params"]])
        return 1.0

    monkeypatch.setattr(speeds, "best_seconds", once)
    numel = speeds.adam_timing_numel()
    assert speeds.adam_params_per_s(seconds=0.01) == numel  # params per (fake) second
    assert timed == [[(numel, numel)]]
    state_bytes = 4 * 4 * numel  # fp32 param, grad, exp_avg, exp_avg_sq
    assert numel >= PIECE_NUMEL
    cache = speeds.last_level_cache_bytes()
    assert cache is None or state_bytes >= 4 * cache


@pytest.mark.parametrize(
    "size, cache_bytes", [("32768K", 32 << 20), ("480M", 480 << 20), ("1G", 1 << 30)]
)
def test_the_timed_state_outgrows_any_reported_cache(
    tmp_path: Path, size: str, cache_bytes: int
) -> None:
    """A machine reporting a 480 MiB L3 (seen) times more than one piece: 4x its cache."""
    for index, text in (("index0", "48K"), ("index3", size)):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(text + "\n")
    assert speeds.last_level_cache_bytes(tmp_path) == cache_bytes
    numel = speeds.adam_timing_numel(cache_bytes)
    assert 16 * numel >= 4 * cache_bytes and numel >= PIECE_NUMEL
    assert speeds.adam_timing_numel(0) == PIECE_NUMEL  # no cache reported: one piece
