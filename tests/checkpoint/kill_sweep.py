"""Kill a training process at a chosen file-system call, resume, and compare with a run that never
stopped (run as a script by tests/checkpoint/test_kill_points.py).

Each *life* is a child forked from this process (which imports torch but runs nothing, so a
fork starts in well under a second): it resumes from the run directory's newest checkpoint if
there is one, trains to `STEPS` with a checkpoint after every step (keep 1, so every save also
prunes, and every flush retires and recycles chunks), and SIGKILLs itself at the `k`-th
file-system call (link, rename, unlink, mkdir, rmdir, open, fsync, syncfs, ftruncate, pwrite)
made inside the `nth` call of a phase -- a function wrapped by name -- or, with `k` = 0, right
after that call returns. A later life resumes and finishes; its final checkpoint must equal the
reference's bitwise (every array, the engine counters, data position and RNG state).

    python kill_sweep.py WORKDIR '[{"phase": "save", "nth": 2, "k": 5}, ...]'

prints one JSON line per point: {"point": ..., "calls": n, "ok": bool, "why": str}.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import signal
import sys
import threading
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine_helpers import SMALL, batches  # noqa: E402
from tierzero import Config, Placement, Tier, models  # noqa: E402
from tierzero.checkpoint import catalog  # noqa: E402
from tierzero.engine import Engine, snapshot  # noqa: E402
from tierzero.storage.nvme.arrays import read_array  # noqa: E402
from tierzero.storage.nvme import chunkfile  # noqa: E402
from tierzero.storage.nvme.spares import SpareFiles  # noqa: E402

STEPS = 3
NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
FS_CALLS = ("link", "rename", "replace", "unlink", "mkdir", "rmdir", "open", "fsync", "ftruncate", "pwrite")
# The phases a kill can land in: a name -> (owner, attribute) wrapped while the life runs.
PHASES = {
    "save": (Engine, "save_checkpoint"),
    "resume": (Engine, "load_checkpoint"),
    "step": (Engine, "train_step"),
    "commit": (snapshot, "_replace_dir"),
    "prune": (snapshot, "prune"),
    "recycle": (SpareFiles, "recycle"),
    "flush": (chunkfile, "sync_filesystem"),
}


def config(work: Path) -> Config:
    return Config(placement=NVME, nvme_path=[str(work / "nvme")], lr=3e-3, warmup_steps=1,
                  total_steps=STEPS, host_budget="256MiB", gpu_budget="256MiB",
                  chunk_bytes=64 << 10)


class KillSwitch:
    """Counts file-system calls inside the `nth` call of `phase`; SIGKILLs at the `k`-th."""

    def __init__(self, phase: str, nth: int, k: int) -> None:
        self.phase, self.nth, self.k = phase, nth, k
        self.entered = 0
        self.inside = False
        self.calls = 0
        self.kinds: dict[str, int] = {}
        self.lock = threading.Lock()

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def count(self, name: str) -> None:
        with self.lock:
            if not self.inside:
                return
            self.calls += 1
            self.kinds[name] = self.kinds.get(name, 0) + 1
            if self.calls == self.k:
                self.die()

    def install(self) -> None:
        owner, attr = PHASES[self.phase]
        inner = getattr(owner, attr)

        def phase(*args, **kwargs):
            self.entered += 1
            mine = self.entered == self.nth
            self.inside = self.inside or mine
            try:
                result = inner(*args, **kwargs)
            finally:
                if mine:
                    self.inside = False
            if mine and self.k == 0:
                self.die()
            return result

        setattr(owner, attr, phase)
        for name in FS_CALLS:
            setattr(os, name, self._counted(name, getattr(os, name)))
        setattr(builtins, "open", self._counted("open", builtins.open))
        if chunkfile._syncfs is not None:
            chunkfile._syncfs = self._counted("syncfs", chunkfile._syncfs)

    def _counted(self, name: str, fn):
        def call(*args, **kwargs):
            if _mutates(name, args, kwargs):
                self.count(name)
            return fn(*args, **kwargs)
        return call


def _mutates(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the call can change what is on disk (an open for reading cannot)."""
    if name != "open":
        return True
    flags = args[1] if len(args) > 1 else kwargs.get("flags", kwargs.get("mode", "r"))
    if isinstance(flags, str):
        return any(c in flags for c in "wax+")
    return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))


def life(work: Path, switch: KillSwitch | None) -> None:
    """Resume (or start), train to STEPS with a checkpoint each step, then record the calls seen."""
    torch.set_num_threads(1)
    torch.manual_seed(0)  # as `tierzero train --seed 0` does; a resume restores the saved state
    if switch is not None:
        switch.install()
    run_dir = work / "run"
    (work / "nvme").mkdir(parents=True, exist_ok=True)
    cfg = config(work)
    data = batches(batch_size=2)
    engine = Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg)
    try:
        if catalog.checkpoint_dirs(run_dir):
            data.load_state_dict(engine.load_checkpoint(run_dir).data)
        else:
            engine.open()
        while engine.step_count < STEPS:
            engine.train_step(data.next_batch())
            engine.save_checkpoint(run_dir, data=data.state_dict(), keep=1)
    finally:
        engine.close()
    if switch is not None:
        (work / "calls").write_text(json.dumps([switch.calls, switch.kinds]))


def same_final_state(a_dir: Path, b_dir: Path) -> str | None:
    """Why the newest checkpoints of two run directories differ, or None."""
    (a_path, a, _), (b_path, b, _) = catalog.newest_checkpoint(a_dir), catalog.newest_checkpoint(b_dir)
    if a.step != b.step:
        return f"steps {a.step} != {b.step}"
    for what in ("engine", "data", "rng"):
        if getattr(a, what) != getattr(b, what):
            return f"{what} differs"
    if a.arrays.keys() != b.arrays.keys():
        return "arrays differ"
    for key in a.arrays:
        if not torch.equal(read_array(str(a.array_dir(a_path, key)), a.arrays[key]),
                           read_array(str(b.array_dir(b_path, key)), b.arrays[key])):
            return f"{key} differs"
    return None


def in_child(fn, *args) -> tuple[int, str]:
    """Run `fn(*args)` in a forked child; its exit signal or status, and its error text."""
    err = Path(args[0]) / "error"
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except BaseException:
            err.write_text(traceback.format_exc())
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    text = err.read_text() if err.exists() else ""
    err.unlink(missing_ok=True)
    return (-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)), text


def run_point(work: Path, reference: Path, point: dict) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    first = KillSwitch(point["phase"], point["nth"], point["k"])
    if point["phase"] == "resume":  # a killed run first, then a resume killed in turn
        status, text = in_child(life, work, KillSwitch("save", 2, 0))
        if status != -signal.SIGKILL:
            return {"point": point, "ok": False, "why": f"the first life ended {status}: {text}"}
    status, text = in_child(life, work, first)
    calls = json.loads((work / "calls").read_text()) if (work / "calls").exists() else None
    if status not in (0, -signal.SIGKILL):
        return {"point": point, "ok": False, "why": f"the killed life failed ({status}): {text}"}
    killed = status == -signal.SIGKILL
    if killed:
        status, text = in_child(life, work, None)
        if status != 0:
            return {"point": point, "ok": False, "why": f"the resumed life failed ({status}): {text}"}
    why = same_final_state(work / "run", reference / "run")
    return {"point": point, "killed": killed, "calls": calls, "ok": why is None, "why": why}


def main() -> None:
    base, points = Path(sys.argv[1]), json.loads(sys.argv[2])
    reference = base / "reference"
    shutil.rmtree(reference, ignore_errors=True)
    reference.mkdir(parents=True)
    status, text = in_child(life, reference, None)
    assert status == 0, text
    try:
        for i, point in enumerate(points):
            print(json.dumps(run_point(base / f"p{i}", reference, point)), flush=True)
            shutil.rmtree(base / f"p{i}", ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
