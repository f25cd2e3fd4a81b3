"""Ctrl-C ends `tierzero train` with exit code 130 and one line saying where it stopped and what
--resume continues from (SIGTERM the same, with exit code 143), on one rank and on `--nproc 2`
ranks (the launcher passes SIGINT on and rank 0 speaks); ranks die with their launcher, so
SIGKILL of it leaves none training."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.run.directory import read_metrics

ARGS = [
    "--steps",
    "100000",
    "--batch-size",
    "2",
    "--seq-len",
    "32",
    "--dtype",
    "fp32",
    "--offload",
    "nvme",
    "--checkpoint-every",
    "2",
    "--comm-timeout",
    "60",
]
HANG_GUARD_S = 300  # a guard against a hang, not a timing threshold
LINE = re.compile(
    r"error: interrupted at step (\d+); last checkpoint step (\d+); continue with --resume"
)


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tierzero.cli", "train", *ARGS, *extra, "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        if (run_dir / "metrics.jsonl").is_file() and any(
            r.get("step") == step and "loss" in r for r in read_metrics(run_dir)
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never finished")


def interrupt(
    run_dir: Path, proc: subprocess.Popen, signum: int = signal.SIGINT
) -> tuple[int, str]:
    try:
        wait_for_step(run_dir, 3, proc)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        proc.kill()
    return proc.returncode, err


def check_line(err: str, run_dir: Path, line: re.Pattern = LINE) -> tuple[int, int]:
    """The one line on stderr; the steps it names agree with the run directory."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    match = line.fullmatch(lines[0])
    assert match, err
    step, saved = int(match[1]), int(match[2])
    assert step >= 3 and saved == step - step % 2
    assert max(s for s, _ in checkpoint_dirs(run_dir)) == saved
    return step, saved


def test_ctrl_c_on_one_rank_exits_130_and_says_where_to_resume(tmp_path) -> None:
    run_dir = tmp_path / "run"
    code, err = interrupt(run_dir, start(run_dir))
    assert code == 130, err
    _, saved = check_line(err, run_dir)
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierzero.cli",
            "train",
            "--resume",
            "--run-dir",
            str(run_dir),
            "--steps",
            str(saved + 1),
        ],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from checkpoint step {saved}" in resumed.stdout


def test_sigterm_exits_143_with_the_same_line(tmp_path) -> None:
    run_dir = tmp_path / "run"
    code, err = interrupt(run_dir, start(run_dir), signal.SIGTERM)
    assert code == 143, err
    check_line(err, run_dir, re.compile(LINE.pattern.replace("interrupted", "stopped by SIGTERM")))


def test_ctrl_c_with_nproc_exits_130_with_one_line(tmp_path) -> None:
    run_dir = tmp_path / "run"
    code, err = interrupt(run_dir, start(run_dir, "--nproc", "2"))
    assert code == 130, err
    check_line(err, run_dir)


def _workers(launcher: int) -> list[int]:
    """The pids whose parent is the launcher (torchrun's workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if any(
            line.split()[1:] == [str(launcher)]
            for line in status.splitlines()
            if line.startswith("PPid:")
        ):
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_ranks_die_with_their_launcher(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc", "2")
    workers: list[int] = []
    try:
        wait_for_step(run_dir, 2, proc)
        workers = _workers(proc.pid)
        assert len(workers) == 2
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + HANG_GUARD_S
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers)
    finally:
        proc.kill()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
