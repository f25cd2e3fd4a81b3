"""Kills after a checkpoint's commit, after pruning retired the old one, and while the store
recycles retired chunks into spares -- not only before the rename -- each resumed to a final
checkpoint bitwise equal to an uninterrupted run's (every array, counters, data position, RNG).

The lives run in one driver process (tests/checkpoint/kill_sweep.py: forked children on a tiny
model, a few seconds each). `TIERZERO_KILL_SWEEP=all` instead kills at every file-system call
of a save and of a resume (hundreds of lives; minutes, run by hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("kill_sweep.py")
POINTS = [
    {"phase": "commit", "nth": 2, "k": 0},   # right after step-2's rename, before prune
    {"phase": "prune", "nth": 2, "k": 0},    # right after step-1 was removed
    {"phase": "recycle", "nth": 2, "k": 1},  # during the flush's recycling, at its first call
]  # kills before the rename: tests/checkpoint/test_crash_resume.py


def sweep_points() -> list[dict]:
    """Every call of the second save and of a resume (counts found by a run that is not killed)."""
    return ([{"phase": "save", "nth": 2, "k": k} for k in range(1, 340)]
            + [{"phase": "resume", "nth": 1, "k": k} for k in range(1, 350)])


def run_driver(work: Path, points: list[dict], timeout_s: float) -> list[dict]:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else work  # no disk syncs to wait for
    done = subprocess.run([sys.executable, str(DRIVER), str(base / f"kills-{os.getpid()}-{work.name}"),
                           json.dumps(points)], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_kills_after_commit_prune_and_during_recycle_resume_bitwise(tmp_path: Path) -> None:
    results = run_driver(tmp_path, POINTS, timeout_s=600)
    assert len(results) == len(POINTS)
    for r in results:
        assert r["killed"] and r["ok"], r


@pytest.mark.skipif(os.environ.get("TIERZERO_KILL_SWEEP") != "all", reason="minutes: TIERZERO_KILL_SWEEP=all")
def test_a_kill_at_every_file_system_call_of_a_save_and_a_resume(tmp_path: Path) -> None:
    bad = [r for r in run_driver(tmp_path, sweep_points(), timeout_s=6 * 3600) if not r["ok"]]
    assert not bad, bad[:3]
