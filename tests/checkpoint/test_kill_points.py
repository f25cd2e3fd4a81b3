"""Kills after a checkpoint's commit, after pruning retired the old one, and while the store
recycles retired chunks into spares -- not only before the rename -- each resumed to a final
checkpoint bitwise equal to an uninterrupted run's (every array, counters, data position, RNG);
and one kill in each other path the engine trains on (`kill_sweep.PATHS`: the vertical schedule
spilling activations, the clip re-step holding kept generations, bf16, fp16 with a skipped step,
compact optimizer state with bf16 grads on NVMe and in host memory, and stepped on the compute
device by choice, host and auto placements, two ranks, a frozen base stored in NF4), each resumed
bitwise or refused in one sentence.

The lives run in one driver process (tests/support/scripts/kill_sweep.py: forked children on a tiny
model, a few seconds each). The soak, `TIERZERO_KILL_SWEEP=all` (or a comma-separated list of
path names), instead kills at every file-system call of a step, of a save and of a resume on
each path (thousands of lives; hours, run by hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.scripts.kill_sweep import PATHS

DRIVER = Path(__file__).parents[1] / "support" / "scripts" / "kill_sweep.py"
POINTS = [
    {"phase": "commit", "nth": 2, "k": 0},  # right after step-2's rename, before prune
    {"phase": "prune", "nth": 2, "k": 0},  # right after step-1 was removed
    {"phase": "recycle", "nth": 2, "k": 1},  # during the flush's recycling, at its first call
]  # kills before the rename: tests/checkpoint/test_crash_resume.py
# One kill per path, in that path's own calls: at the `k`-th, or, where a text is given, at the
# first call from the `k`-th on whose target contains it (the order of threaded writes varies).
PATH_POINTS = [
    ({"path": "vertical", "phase": "step", "nth": 4, "k": 3}, "/act/"),  # an activation's spill
    # a step while kept generations are held
    ({"path": "restep", "phase": "step", "nth": 2, "k": 40}, None),
    ({"path": "bf16", "phase": "save", "nth": 2, "k": 30}, None),
    # a skipped step's save replacing its step's checkpoint: at the swap, and right after it
    ({"path": "fp16", "phase": "commit", "nth": 2, "k": 1}, "exchange"),
    ({"path": "fp16", "phase": "commit", "nth": 2, "k": 2}, None),
    # memory-homed shards written
    ({"path": "host", "phase": "save", "nth": 2, "k": 60}, "/checkpoints/"),
    ({"path": "auto", "phase": "save", "nth": 2, "k": 60}, "/checkpoints/"),
    # rank 1's own store
    ({"path": "two-ranks", "rank": 1, "phase": "save", "nth": 2, "k": 20}, "/rank1/"),
    # an int8 moment's chunk (absmax blocks, then codes) linked into the checkpoint; a step
    # writing compact pieces through spares; a bf16 moment's chunk written from host memory
    ({"path": "compact", "phase": "save", "nth": 2, "k": 1}, "/nvme/exp_avg/u0001/"),
    ({"path": "compact", "phase": "step", "nth": 2, "k": 50}, None),
    ({"path": "compact-host", "phase": "save", "nth": 2, "k": 1}, "/state/exp_avg/u0000/"),
    # a device step's piece written back from its host buffer, and its int8 chunk linked
    ({"path": "device-step", "phase": "step", "nth": 2, "k": 50}, None),
    ({"path": "device-step", "phase": "save", "nth": 2, "k": 1}, "/nvme/exp_avg/u0001/"),
    # an NF4 base's coded chunk (written once at open) linked into the second checkpoint, and
    # linked back from the checkpoint into the store by a resume
    ({"path": "nf4", "phase": "save", "nth": 2, "k": 1}, "nvme/param/u0001/r0/p0001/g"),
    ({"path": "nf4", "phase": "resume", "nth": 1, "k": 1}, "param/u0001/r0/p0001/c/0 ->"),
]


def run_driver(work: Path, points: list[dict], timeout_s: float, echo: bool = False) -> list[dict]:
    """The driver's result for each point; with `echo`, each result line is printed as it comes
    (a soak's log then shows how far it got, not only its end)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else work  # no disk syncs to wait for
    errors = work / f"driver-stderr-{len(list(work.glob('driver-stderr-*')))}"
    with open(errors, "w+") as stderr:
        driver = subprocess.Popen(
            [
                sys.executable,
                str(DRIVER),
                str(base / f"kills-{os.getpid()}-{work.name}"),
                json.dumps(points),
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        timer = threading.Timer(timeout_s, driver.kill)
        timer.start()
        try:
            lines = []
            for line in driver.stdout:
                lines.append(line)
                if echo:
                    print(line, end="", flush=True)
            returncode = driver.wait()
        finally:
            timer.cancel()
        stderr.seek(0)
        assert returncode == 0, f"the driver ended {returncode}: {stderr.read()}"
    return [json.loads(line) for line in lines]


def test_kills_after_commit_prune_and_during_recycle_resume_bitwise(tmp_path: Path) -> None:
    results = run_driver(tmp_path, POINTS, timeout_s=600)
    assert len(results) == len(POINTS)
    for r in results:
        assert r["killed"] and r["ok"], r


def test_a_kill_in_each_path_resumes_bitwise_or_is_refused(tmp_path: Path) -> None:
    points = [{**p, "match": where} if where else p for p, where in PATH_POINTS]
    results = run_driver(tmp_path, points, timeout_s=900)
    assert len(results) == len(PATH_POINTS)
    for r, (_, where) in zip(results, PATH_POINTS):
        assert r["killed"] and r["ok"], r
        assert where is None or where in r["at"], r


def soak_phases(name: str) -> list[dict]:
    """Every phase the soak kills in on a path: the second step (a previous checkpoint to resume
    from; vertically, its last micro-batch runs it), the second save, the first resume -- on
    each rank."""
    nth_step = 2 * PATHS[name].accumulate
    return [
        {"path": name, "rank": rank, "phase": phase, "nth": nth}
        for rank in range(PATHS[name].ranks)
        for phase, nth in (("step", nth_step), ("save", 2), ("resume", 1))
    ]


def soak_points(tmp_path: Path, name: str) -> list[dict]:
    """k = 0 (right after the phase) and every call of each soak phase: counted by lives that
    are not killed (k = -1)."""
    counted = run_driver(tmp_path, [{**p, "k": -1} for p in soak_phases(name)], timeout_s=3600)
    return [{**r["point"], "k": k} for r in counted for k in range(r["calls"][0] + 1)]


SOAK = os.environ.get("TIERZERO_KILL_SWEEP", "")


@pytest.mark.parametrize("name", list(PATHS))
@pytest.mark.skipif(
    not SOAK, reason="hours: TIERZERO_KILL_SWEEP=all, or a comma-separated list of paths"
)
def test_a_kill_at_every_file_system_call_of_a_step_a_save_and_a_resume(
    tmp_path: Path, name: str
) -> None:
    if SOAK != "all" and name not in SOAK.split(","):
        pytest.skip(f"{name} is not in TIERZERO_KILL_SWEEP")
    results = run_driver(tmp_path, soak_points(tmp_path, name), timeout_s=48 * 3600, echo=True)
    bad = [r for r in results if not r["ok"]]
    refused = sum("refused" in r for r in results)
    by_phase = {}
    for r in results:
        key = f"{r['point']['phase']}@rank{r['point']['rank']}"
        by_phase[key] = by_phase.get(key, 0) + 1
    print(
        f"\n{name}: {len(results)} kill points {by_phase}, {len(bad)} failed, {refused} refused, "
        f"the rest bitwise"
    )
    assert not bad, bad[:3]
