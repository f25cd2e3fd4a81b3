"""Ranks: which one this process is, its process group and device, and torchrun for the CLI.

A multi-rank run is started by torchrun (`torch.distributed.run`), either by the user
(`torchrun --nproc-per-node 2 -m tierzero.cli train ...`, or with `--nnodes` and a c10d
rendezvous across machines) or by `tierzero train --nproc N`, which runs torchrun's own
launcher in-process: tierzero has no launcher or transport of its own. torchrun tells each
worker who it is through the environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE).

Each worker binds `cuda:LOCAL_RANK` when there is CUDA (NCCL for GPU tensors, gloo for the
small CPU ones: the mixed backend `cpu:gloo,cuda:nccl`), else the CPU with gloo. Collectives
time out after `timeout_s`, so a rank that hangs ends the others with an error instead of a
silent wait; a rank that dies closes its connections, which the others see at once, and
torchrun's agent stops the survivors when any worker exits with an error.

Ctrl-C reaches the launcher only (torchrun starts each worker in a session of its own); its agent
passes the signal on to every worker, waits for them, and `run_torchrun` raises `RanksStopped`.
Workers die with their launcher: each asks the kernel for SIGTERM when its parent dies
(`die_with_launcher`), so a launcher killed by SIGKILL leaves no rank training.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tierzero.distributed.comm import Comm
from tierzero.errors import ConfigError, TierzeroError


@dataclass(frozen=True)
class Ranks:
    """Where this process sits: its global and local rank among how many."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def primary(self) -> bool:
        """Rank 0 prints, writes metrics and commits checkpoints."""
        return self.rank == 0


def ranks_from_env() -> Ranks:
    """What torchrun set for this worker; one rank when it did not start us."""
    env = os.environ
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return Ranks()
    try:
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return Ranks(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), local_world)
    except ValueError:
        raise ConfigError(
            f"the environment's RANK/WORLD_SIZE/LOCAL_RANK ({env.get('RANK')}/"
            f"{env['WORLD_SIZE']}/{env.get('LOCAL_RANK')}) are not integers; start "
            "ranks with torchrun"
        ) from None


def local_world_size(comm: Comm | None = None) -> int:
    """Ranks on this machine (they share its RAM and drives): torchrun's LOCAL_WORLD_SIZE; in a
    process group started another way (`mp.spawn`, a user's own launcher), the ranks whose host
    name is this one's, counted through `comm` (a collective: every rank must call it); else 1."""
    if "LOCAL_WORLD_SIZE" in os.environ or comm is None or comm.world_size == 1:
        return ranks_from_env().local_world_size
    host = socket.gethostname()
    return sum(name == host for name in comm.all_gather_json(host))


def rank_device(ranks: Ranks, device: str | None) -> str | None:
    """The device this rank computes on: `cuda:LOCAL_RANK` when CUDA is there and the user did
    not name a device (a bare `cuda` also binds the local rank's GPU)."""
    if ranks.world_size == 1:
        return device
    if device in (None, "cuda") and torch.cuda.is_available():
        if ranks.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"local rank {ranks.local_rank} has no GPU: this machine has "
                f"{torch.cuda.device_count()}; start at most that many ranks per machine"
            )
        return f"cuda:{ranks.local_rank}"
    return device


def start_process_group(ranks: Ranks, device: str | None, timeout_s: float) -> None:
    """Join the job's process group (torchrun's env:// rendezvous); a no-op for one rank."""
    if ranks.world_size == 1 or dist.is_initialized():
        return
    if device is not None and device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    try:
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as e:
        raise TierzeroError(
            f"rank {ranks.rank} could not join the other {ranks.world_size - 1} rank(s) "
            f"({e}); start every rank with torchrun and the same rendezvous flags"
        ) from None


def stop_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


class RanksStopped(KeyboardInterrupt):
    """The launcher got `signum` (Ctrl-C: SIGINT) and torchrun's agent passed it on to the ranks
    and waited for them: on SIGINT rank 0 has already said where the run stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_LAUNCHER_PID = "TIERZERO_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> None:
    """Ask the kernel to send this rank SIGTERM when the process that started it (torchrun's
    agent) dies, however it dies; exit now if it is already gone. Linux only, and only under
    torchrun's agent (TORCHELASTIC_RUN_ID): a user's own launcher script may exit while its ranks
    train."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # no death signal to be had: the rank still ends when its collectives time out
    launcher = os.environ.get(_LAUNCHER_PID)
    if launcher is not None and os.getppid() != int(launcher):  # it died before prctl took hold
        os.kill(os.getpid(), signal.SIGTERM)


def run_torchrun(nproc: int, module: str, args: list[str]) -> None:
    """Run `python -m module args` as `nproc` ranks on this machine through torchrun's own
    launcher (standalone rendezvous); returns when all finished, raises naming the first rank
    that failed (torchrun's agent stops the others then), or `RanksStopped` when a signal
    (Ctrl-C) stopped the launcher and, through it, the ranks."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # torchrun would set 1 thread per rank (and warn); share the machine's cores instead
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    launcher = get_args_parser().parse_args(
        [
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--monitor-interval",
            "0.5",
            "--module",
            module,
            *args,
        ]
    )
    os.environ[_LAUNCHER_PID] = str(os.getpid())  # the ranks' parent: torchrun runs in this process
    # the agent's warnings ("death signal, shutting down workers") would be noise around our one
    # line; each of its modules sets its own logger's level
    agent_logs = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("torch.distributed.elastic")
    ]
    levels = [log.level for log in agent_logs]
    for log in agent_logs:
        log.setLevel(logging.ERROR)
    try:
        run(launcher)
    except ChildFailedError as e:
        raise TierzeroError(failure_text(e.failures)) from None
    except SignalException as e:
        raise RanksStopped(int(e.sigval)) from None
    finally:
        for log, level in zip(agent_logs, levels):
            log.setLevel(level)


def failure_text(failures: dict[int, Any]) -> str:
    """One sentence naming the rank that failed first and how (exit code or signal), then the
    others torchrun stopped or that failed after it."""

    def how(failure: Any) -> str:
        return (
            f"was killed by {failure.signal_name()}"
            if failure.exitcode < 0
            else f"exited with code {failure.exitcode}"
        )

    # SIGTERM is how torchrun's agent stops the survivors: a rank ended by it did not fail first
    order = sorted(
        failures.items(),
        key=lambda item: (item[1].exitcode == -signal.SIGTERM, item[1].timestamp, item[0]),
    )
    (first, failure), rest = order[0], order[1:]
    after = "".join(f"; then rank {rank} {how(f)}" for rank, f in rest)
    return (
        f"rank {first} {how(failure)}{after}; torchrun stopped the other ranks, and the run "
        "directory keeps its last complete checkpoint (continue with --resume)"
    )
