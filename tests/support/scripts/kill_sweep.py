"""Kill a training process at a chosen file-system call, resume, and compare with a run that never
stopped (run as a script by tests/checkpoint/test_kill_points.py).

Each *life* is a child forked from this process (which imports torch and the compact kernel and
builds a model on meta once but runs nothing, so a fork starts in well under a second): it resumes
from the run directory's newest checkpoint if there is one, trains to `STEPS` with a checkpoint
after every step (keep 1, so every save also prunes, and every flush retires and recycles chunks),
and SIGKILLs itself at the `k`-th file-system call (link, rename, exchange, unlink, mkdir, rmdir,
open, fsync, syncfs, ftruncate, pwrite) made inside the `nth` call of a phase -- a function wrapped
by name -- or, with `k` = 0, right after that call returns (`k` = -1 never kills: the life only
counts the calls); with `match`, at the first call from the `k`-th on whose name and target contain
that text (threads write chunks in no fixed order, so a call's number alone can land elsewhere). A
kill must leave the newest checkpoint committed before it; a later life resumes and finishes, and
its final checkpoint must equal the reference's bitwise (every array, the engine counters, data
position and RNG state of every rank), or the resume must be refused in one sentence (a
`TierzeroError`).

A point names the *path* it trains (`PATHS`): everything on NVMe (the default); the vertical
schedule with most waiting activations spilled to NVMe; the exact clip re-step of an overlapped step
with the kept generations held on the drive; bf16 and fp16 compute (fp16 with a loss scale that
grows until steps overflow and are skipped); compact optimizer state with bf16 grads (int8 moments
and a bf16 master on NVMe; bf16 moments and an fp32 master in host memory); host and auto
placements; two ranks (gloo, forked: a kill there SIGKILLs both, as a launcher tears down a job
whose rank died); the blocks' linear weights a frozen base stored in NF4 on NVMe.

    python kill_sweep.py WORKDIR '[{"path": "vertical", "phase": "save", "nth": 2, "k": 5}, ...]'

prints one JSON line per point: {"point": ..., "killed": bool, "at": the call killed in, "calls":
[n, by kind] (a life that was not killed), "ok": bool, "why": str, or "refused": the sentence}.
"""

from __future__ import annotations

import builtins
import datetime
import json
import os
import shutil
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo: tests.support

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tierzero.storage.nvme import chunkfile  # noqa: E402
from tierzero.storage.nvme.arrays import read_array  # noqa: E402
from tierzero.storage.nvme.spares import SpareFiles  # noqa: E402

from tests.support.engine import SMALL, batches, engine_config  # noqa: E402
from tierzero import Config, Placement, Tier, models  # noqa: E402
from tierzero.checkpoint import catalog  # noqa: E402
from tierzero.compact import cpu_step  # noqa: E402
from tierzero.engine import Engine, checkpointing  # noqa: E402
from tierzero.errors import TierzeroError  # noqa: E402

STEPS = 3
BATCH = 2  # sequences per micro-batch (per rank: each of two ranks trains on its half of 2 x BATCH)
NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
HOST = Placement(Tier.GPU, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)
ACTIVATION_BYTES = BATCH * 32 * SMALL.dim * 4  # one micro-batch's input to a block, fp32


@dataclass(frozen=True)
class TrainPath:
    """What a life trains with: engine settings beside the common ones, how many ranks, and
    whether the blocks' linear weights are a frozen base (the norms, embedding and head train)."""

    settings: dict[str, Any] = field(default_factory=dict)
    ranks: int = 1
    frozen_linears: bool = False

    @property
    def accumulate(self) -> int:
        return self.settings.get("accumulate", 1)


PATHS = {
    "nvme": TrainPath(),
    # accumulate 2 over 3 blocks: 6 waiting activations of 16 KiB and the tied embedding's two
    # 64 KiB grads from the head, with room for 80 KiB: most are spilled to NVMe and read back
    "vertical": TrainPath(
        {"accumulate": 2, "schedule": "vertical", "activation_budget": 5 * ACTIVATION_BYTES}
    ),
    # SMALL's grad norms are above 0.5: every step's clip fires and re-steps from the kept
    # generation
    "restep": TrainPath({"overlap_step": True, "clip_grad_norm": 0.5}),
    "bf16": TrainPath({"dtype": "bf16"}),
    # the scale doubles after every good step until fp16's grads overflow: 5 micro-batches for 3
    # steps, each skipped one saved again over its step's checkpoint
    "fp16": TrainPath({"dtype": "fp16", "loss_scale": 2.0**16, "loss_scale_window": 1}),
    "host": TrainPath({"placement": HOST}),
    # what the planner picks for these budgets: everything on the compute device
    "auto": TrainPath({"placement": None, "offload": "auto"}),
    "two-ranks": TrainPath(
        {"placement": Placement(Tier.NVME, Tier.HOST, Tier.NVME, Tier.NVME, Tier.HOST)}, ranks=2
    ),
    # int8 moments (one uint8 piece: absmax blocks, then codes) and a bf16 master that is the
    # param itself, bf16 grads (one micro-batch per step), all on NVMe, stepped by the CPU kernel
    "compact": TrainPath({"dtype": "bf16", "optimizer_state": "int8", "master": "bf16"}),
    # bf16 moments and an fp32 master beside the bf16 param, homed in host memory with the bf16
    # grads: the save writes memory-homed compact shards, the resume fills them from the checkpoint
    "compact-host": TrainPath(
        {"dtype": "bf16", "optimizer_state": "bf16", "master": "fp32", "placement": HOST}
    ),
    # the compact path stepped on the compute device by choice: each piece read from NVMe into
    # a host buffer, copied into the device pool, stepped, copied back and written from there
    "device-step": TrainPath(
        {"dtype": "bf16", "optimizer_state": "int8", "master": "bf16", "optimizer_device": "gpu"}
    ),
    # the blocks' linear weights a frozen base stored in NF4 on NVMe: coded once at open, every
    # checkpoint linking the same coded chunks, read back and decoded through a resume
    "nf4": TrainPath({"quantize_base": "nf4"}, frozen_linears=True),
}
FS_CALLS = (
    "link",
    "rename",
    "replace",
    "unlink",
    "mkdir",
    "rmdir",
    "open",
    "fsync",
    "ftruncate",
    "pwrite",
)
_os_open = os.open  # the switch's own record of where it killed is no kill point
# The phases a kill can land in: a name -> (owner, attribute) wrapped while the life runs.
PHASES = {
    "save": (Engine, "save_checkpoint"),
    "resume": (Engine, "load_checkpoint"),
    "step": (Engine, "train_micro_batch"),  # a micro-batch, and the step at the last
    "commit": (checkpointing, "_replace_dir"),
    "prune": (checkpointing, "prune"),
    "recycle": (SpareFiles, "recycle"),
    "flush": (chunkfile, "sync_filesystem"),
}


def config(work: Path, path: TrainPath) -> Config:
    return engine_config(
        work, **{"warmup_steps": 1, "total_steps": STEPS, "chunk_bytes": 64 << 10, **path.settings}
    )


class KillSwitch:
    """Counts file-system calls inside the `nth` call of `phase`; SIGKILLs at the `k`-th (with
    `group`, this process's whole process group: every rank of the life)."""

    def __init__(
        self, phase: str, nth: int, k: int, group: bool = False, match: str | None = None
    ) -> None:
        self.phase, self.nth, self.k, self.group, self.match = phase, nth, k, group, match
        self.entered = 0
        self.inside = False
        self.calls = 0
        self.kinds: dict[str, int] = {}
        self.lock = threading.Lock()
        self.at: Path | None = None  # where `die` records the call it kills in

    def die(self, name: str, args: tuple) -> None:
        if self.at is not None:  # what the call was about to touch, for the caller to check
            _record(self.at, f"{name} {_target(args)}")
        if self.group:
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def count(self, name: str, args: tuple) -> None:
        with self.lock:
            if not self.inside:
                return
            self.calls += 1
            self.kinds[name] = self.kinds.get(name, 0) + 1
            if self.match is None:
                if self.calls == self.k:
                    self.die(name, args)
            elif 0 < self.k <= self.calls and self.match in f"{name} {_target(args)}":
                self.die(name, args)

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
                self.die(f"after {self.phase}", ())
            return result

        setattr(owner, attr, phase)
        for name in FS_CALLS:
            setattr(os, name, self._counted(name, getattr(os, name)))
        builtins.open = self._counted("open", builtins.open)
        if chunkfile.syncfs is not None:
            chunkfile.syncfs = self._counted("syncfs", chunkfile.syncfs)
        if chunkfile.renameat2 is not None:
            chunkfile.renameat2 = self._counted("exchange", chunkfile.renameat2)

    def _counted(self, name: str, fn):
        def call(*args, **kwargs):
            if _mutates(name, args, kwargs):
                self.count(name, args)
            return fn(*args, **kwargs)

        return call


def _record(path: Path, text: str) -> None:
    """Write a note of the harness's own, through calls the switch does not count."""
    fd = _os_open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _target(args: tuple) -> str:
    """The path(s) a file-system call is about to touch (a descriptor's, through /proc)."""
    paths = [os.fsdecode(a) for a in args if isinstance(a, (str, bytes, os.PathLike))]
    if paths:
        return " -> ".join(paths[:2])
    if args and isinstance(args[0], int):
        try:
            return os.readlink(f"/proc/self/fd/{args[0]}")
        except OSError:
            return f"fd {args[0]}"
    return ""


def _mutates(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the call can change what is on disk (an open for reading cannot)."""
    if name != "open":
        return True
    flags = args[1] if len(args) > 1 else kwargs.get("flags", kwargs.get("mode", "r"))
    if isinstance(flags, str):
        return any(c in flags for c in "wax+")
    return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))


def life(work: Path, path: TrainPath, switch: KillSwitch | None, rank: int = 0) -> None:
    """Resume (or start), train to STEPS with a checkpoint each step, then record the calls seen."""
    torch.set_num_threads(1)
    torch.manual_seed(0)  # as `tierzero train --seed 0` does; a resume restores the saved state
    if switch is not None:
        switch.at = work / "killed-at"
        switch.install()
    run_dir = work / "run"
    (work / "nvme").mkdir(parents=True, exist_ok=True)
    cfg = config(work, path)
    data = batches(batch_size=BATCH * path.ranks)
    model = models.build(SMALL, device="meta", seed=cfg.seed)
    if path.frozen_linears:
        for block in model.blocks:
            for module in block.modules():
                if type(module) is torch.nn.Linear:
                    module.weight.requires_grad_(False)
    engine = Engine(model, cfg)
    try:
        if catalog.checkpoint_dirs(run_dir):
            data.load_state_dict(engine.load_checkpoint(run_dir).data)
        else:
            engine.open()
        while engine.step_count < STEPS:
            for _ in range(path.accumulate):
                x, y = data.next_batch()
                engine.train_micro_batch(
                    (x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH])
                )
            engine.save_checkpoint(run_dir, data=data.state_dict(), keep=1)
            if rank == 0:
                _record(work / "committed", str(engine.step_count))
    finally:
        engine.close()
    if switch is not None:
        (work / "calls").write_text(json.dumps([switch.calls, switch.kinds]))


def ranks_life(
    work: Path, path: TrainPath, switch: KillSwitch | None, killed_rank: int = 0
) -> None:
    """`life` on `path.ranks` ranks: this process is rank 0 and the leader of a process group
    its forked ranks join, so a kill in any rank takes every rank down at once."""
    if path.ranks == 1:
        return life(work, path, switch)
    os.setpgid(0, 0)
    rendezvous = work / f"rendezvous-{os.getpid()}"  # fresh per life: a killed one's file is stale
    children = []
    for rank in range(1, path.ranks):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _rank_life(work, path, switch if rank == killed_rank else None, rank, rendezvous)
            except BaseException:
                (work / f"error-{rank}").write_text(traceback.format_exc())
                code = 1
            os._exit(code)
        children.append(pid)
    try:
        _rank_life(work, path, switch if killed_rank == 0 else None, 0, rendezvous)
    finally:
        failed = [(os.waitpid(pid, 0)[1], rank) for rank, pid in enumerate(children, 1)]
    for status, rank in failed:
        if status != 0:
            error = work / f"error-{rank}"
            raise RuntimeError(
                f"rank {rank} ended {status}: {error.read_text() if error.exists() else ''}"
            )


def _rank_life(
    work: Path, path: TrainPath, switch: KillSwitch | None, rank: int, rendezvous: Path
) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=path.ranks,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        life(work, path, switch, rank)
    finally:
        dist.destroy_process_group()


def same_final_state(a_dir: Path, b_dir: Path) -> str | None:
    """Why the newest checkpoints of two run directories differ, or None."""
    (a_path, a, _), (b_path, b, _) = (
        catalog.newest_checkpoint(a_dir),
        catalog.newest_checkpoint(b_dir),
    )
    if a.step != b.step:
        return f"steps {a.step} != {b.step}"
    for what in ("engine", "data", "rng", "rank_rng", "world_size"):
        if getattr(a, what) != getattr(b, what):
            return f"{what} differs"
    if a.arrays.keys() != b.arrays.keys():
        return "arrays differ"
    for key in a.arrays:  # bitwise: an NF4 base's coded pieces, viewed as floats, hold NaNs
        if not torch.equal(
            read_array(str(a.array_dir(a_path, key)), a.arrays[key]).view(torch.uint8),
            read_array(str(b.array_dir(b_path, key)), b.arrays[key]).view(torch.uint8),
        ):
            return f"{key} differs"
    return None


def _lost_checkpoint(work: Path) -> str | None:
    """Why the newest checkpoint a kill left is older than the last one committed before it
    (progress lost, though a resume from further back may still end bitwise), or None."""
    committed = work / "committed"
    if not committed.exists():
        return None
    found = catalog.newest_checkpoint(work / "run")
    newest = found[1].step if found is not None else None
    step = int(committed.read_text())
    if newest is None or newest < step:
        left = "no checkpoint" if newest is None else f"step {newest}"
        return f"the kill left {left} after step {step} had been committed"
    return None


def in_child(fn, *args) -> tuple[int, str]:
    """Run `fn(*args)` in a forked child; its exit signal or status, and its error text (a
    refusal's one sentence, else the traceback)."""
    err = Path(args[0]) / "error"
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except TierzeroError as e:
            err.write_text(f"refused: {e}")
            code = 2
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
    path, rank = PATHS[point.get("path", "nvme")], point.get("rank", 0)
    first = KillSwitch(
        point["phase"], point["nth"], point["k"], group=path.ranks > 1, match=point.get("match")
    )
    if point["phase"] == "resume":  # a killed run first, then a resume killed in turn
        status, text = in_child(
            ranks_life, work, path, KillSwitch("save", 2, 0, path.ranks > 1), rank
        )
        if status != -signal.SIGKILL:
            return {"point": point, "ok": False, "why": f"the first life ended {status}: {text}"}
        (work / "killed-at").unlink()
    status, text = in_child(ranks_life, work, path, first, rank)
    calls = json.loads((work / "calls").read_text()) if (work / "calls").exists() else None
    at = (work / "killed-at").read_text() if (work / "killed-at").exists() else None
    if status not in (0, -signal.SIGKILL):
        return {"point": point, "ok": False, "why": f"the killed life failed ({status}): {text}"}
    killed = status == -signal.SIGKILL
    lost = _lost_checkpoint(work)
    if lost is not None:
        return {"point": point, "killed": killed, "at": at, "ok": False, "why": lost}
    if killed:
        status, text = in_child(ranks_life, work, path, None)
        if status == 2 and "\n" not in text.strip():  # a refusal in one sentence is an allowed end
            return {"point": point, "killed": True, "at": at, "ok": True, "refused": text}
        if status != 0:
            return {
                "point": point,
                "ok": False,
                "why": f"the resumed life failed ({status}): {text}",
            }
    why = same_final_state(work / "run", reference / "run")
    return {
        "point": point,
        "killed": killed,
        "at": at,
        "calls": calls,
        "ok": why is None,
        "why": why,
    }


def main() -> None:
    base, points = Path(sys.argv[1]), json.loads(sys.argv[2])
    # its imports (torch._dynamo: seconds) once, not in every life
    models.build(SMALL, device="meta")
    if cpu_step.installed():  # numba and the compact kernel's import (seconds), also once
        cpu_step.load()
    try:
        references: dict[str, Path] = {}
        for i, point in enumerate(points):
            name = point.get("path", "nvme")
            if name not in references:
                references[name] = base / f"reference-{name}"
                references[name].mkdir(parents=True)
                status, text = in_child(ranks_life, references[name], PATHS[name], None)
                assert status == 0, f"the reference life of {name} failed ({status}): {text}"
            print(json.dumps(run_point(base / f"p{i}", references[name], point)), flush=True)
            shutil.rmtree(base / f"p{i}", ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
