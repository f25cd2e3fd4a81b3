"""The crash test: `tierzero train` SIGKILLed at random moments, resumed each time, ends with
weights bitwise equal to a run that never stopped.

Each kill lands 0-0.4 s after a step's metrics line: inside that step's checkpoint (hard links,
manifest, rename), inside the next step's shard writes, or at the start of the next step
(4 kills over 12 steps here; TIERZERO_CRASH_KILLS=N for N kills over 3N steps). The
exported fp32 weights of both runs are compared tensor by tensor. Bounded: a tiny model, short
sequences, a few seconds per life. Beyond the weights, the final checkpoints of both runs
must hold bitwise equal master weights and Adam moments (every shard), the same engine counters
(step count, skipped steps, loss scaler, per-parameter steps), data position and RNG state.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from tierzero.storage.nvme.arrays import read_array

from tierzero.checkpoint.catalog import newest_checkpoint
from tierzero.checkpoint.export import export_checkpoint

KILLS = int(os.environ.get("TIERZERO_CRASH_KILLS", "4"))  # more for a soak: TIERZERO_CRASH_KILLS=50
STEPS = 3 * KILLS
ARGS = [
    "--steps",
    str(STEPS),
    "--seq-len",
    "32",
    "--batch-size",
    "2",
    "--checkpoint-every",
    "1",
    "--keep-checkpoints",
    "2",
    "--json",
]
CLI = [sys.executable, "-c", "from tierzero.cli.app import main; main()"]


def start(run_dir: Path, resume: bool) -> subprocess.Popen:
    extra = ["--resume"] if resume else []
    return subprocess.Popen(
        [*CLI, "train", "--run-dir", str(run_dir), *ARGS, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished_steps(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return sum(1 for line in lines if '"loss"' in line)


def wait_for_a_new_step(
    proc: subprocess.Popen, run_dir: Path, seen: int, timeout_s: float = 180
) -> bool:
    """True once one more step record is logged; False if the process ended first."""
    deadline = time.monotonic() + timeout_s
    while finished_steps(run_dir) <= seen:
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "training made no progress"
        time.sleep(0.02)
    return True


def export(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """In-process (the CLI's export has its own tests): a subprocess would only add an import."""
    export_checkpoint(run_dir, out, dtype="fp32")
    return load_file(str(out))


def assert_same_final_state(crashed: Path, straight: Path) -> None:
    """Every saved shard (master, Adam moments, params) and every counter of the newest
    checkpoints, compared bitwise."""
    (a_path, a, _), (b_path, b, _) = newest_checkpoint(crashed), newest_checkpoint(straight)
    assert a.step == b.step == STEPS
    assert a.engine == b.engine and a.data == b.data and a.rng == b.rng
    assert a.arrays.keys() == b.arrays.keys() and any(k.startswith("exp_avg_sq/") for k in a.arrays)
    for key in a.arrays:
        assert torch.equal(
            read_array(str(a.array_dir(a_path, key)), a.arrays[key]),
            read_array(str(b.array_dir(b_path, key)), b.arrays[key]),
        ), key


def test_sigkilled_training_resumes_to_bitwise_equal_weights(tmp_path: Path) -> None:
    rng = random.Random(0)
    crashed = tmp_path / "crashed"
    proc = start(crashed, resume=False)
    kills = 0
    try:
        while kills < KILLS:
            if not wait_for_a_new_step(proc, crashed, finished_steps(crashed)):
                break
            time.sleep(rng.uniform(0.0, 0.4))
            proc.kill()
            proc.wait(timeout=60)
            kills += 1
            proc = start(crashed, resume=True)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert kills == KILLS, f"the run finished after {kills} kills; raise STEPS"
    assert json.loads(out)["steps"] == STEPS

    straight = tmp_path / "straight"
    done = subprocess.run(
        [*CLI, "train", "--run-dir", str(straight), *ARGS],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr

    assert_same_final_state(crashed, straight)
    resumed, reference = (
        export(crashed, tmp_path / "a.safetensors"),
        export(straight, tmp_path / "b.safetensors"),
    )
    assert resumed.keys() == reference.keys()
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name
