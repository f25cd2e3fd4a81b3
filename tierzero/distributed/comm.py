"""Collectives over torch.distributed: all-gather a unit's params, reduce-scatter its grads.

With one rank (no process group) both are views/copies and cost nothing; the engine calls
them the same way either way. A collective that fails because another rank died or hung
(gloo reports a reset connection, or the process group's timeout) raises `RankLostError`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tierzero.errors import TierzeroError

# torch's tensor collectives, the process-group boundary every gather and reduce-scatter of `Comm`
# crosses (a test routes them through a fake GPU's comm stream). torch 2.13 renamed them; the old
# names still work back to torch 2.4.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class RankLostError(TierzeroError):
    """A collective failed: another rank stopped or hung."""


_F = TypeVar("_F", bound=Callable[..., Any])


def _collective(method: _F) -> _F:
    """Name a failed collective's cause in one sentence instead of a gloo/NCCL traceback."""

    @functools.wraps(method)
    def run(self: Comm, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as e:
            if self.world_size == 1:
                raise
            raise _lost(self, method.__name__.removesuffix("_async"), e) from None

    return run  # type: ignore[return-value]


def _lost(comm: Comm, what: str, e: Exception) -> RankLostError:
    return RankLostError(
        f"{what} failed on rank {comm.rank} ({_cause(e)}): another rank stopped or hung; "
        "see its error, then continue with --resume"
    )


def _cause(e: Exception) -> str:
    """The cause in a backend's error, e.g. gloo's "[/path/pair.cc:537] Read error [...]: Connection
    reset by peer. This is typically ..." -> "Read error [...]: Connection reset by peer"."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip())
    return text.split(". ")[0].splitlines()[0] if text else type(e).__name__


def reduces_cpu_tensors(backend: str) -> bool:
    """Whether a process group of `backend` (`dist.get_backend()`) takes CPU tensors: "gloo"
    does, "nccl" alone does not, and a per-device one such as the launcher's "cpu:gloo,cuda:nccl"
    does where it names a backend for "cpu"."""
    backend = str(backend).lower()
    if ":" not in backend:
        return backend != "nccl"
    return any(entry.split(":", 1)[0].strip() == "cpu" for entry in backend.split(","))


class Comm:
    """`device`: where NCCL's tensors go (this rank's cuda:k). `reduce_dtype`: the dtype
    gradients travel and are summed in (fp32 by default, for exact sums; bf16 halves the bytes
    on the wire at bf16's 8-bit mantissa)."""

    def __init__(
        self, device: torch.device | str = "cpu", reduce_dtype: torch.dtype = torch.float32
    ) -> None:
        self.device = torch.device(device)
        self.reduce_dtype = reduce_dtype
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The full flat buffer from every rank's shard (one rank: the shard itself)."""
        return self.all_gather_async(shard).wait()

    @_collective
    def all_gather_async(self, shard: torch.Tensor) -> InFlight:
        """Start gathering the full flat buffer; `wait()` returns it. It runs beside compute: on
        gloo's threads, on NCCL's own stream (which waits for what the current stream has queued
        when it is issued, and the current stream for it at `wait()`)."""
        if self.world_size == 1:
            return InFlight(self, "all_gather", None, shard)
        full = torch.empty(shard.numel() * self.world_size, dtype=shard.dtype, device=shard.device)
        return InFlight(
            self, "all_gather", all_gather_tensor(full, shard, async_op=True), full, keep=shard
        )

    @_collective
    def reduce_scatter_async(self, full: torch.Tensor) -> InFlight:
        """Start reducing `full` to this rank's shard of the mean over ranks, as DDP averages
        gradients (one rank: `full` itself), summed in `reduce_dtype`; `wait()` returns the
        shard in `full`'s dtype."""
        if self.world_size == 1:
            return InFlight(self, "reduce_scatter", None, full)
        wire = full.to(self.reduce_dtype)
        shard = torch.empty(full.numel() // self.world_size, dtype=wire.dtype, device=full.device)
        work = reduce_scatter_tensor(shard, wire, async_op=True)
        return InFlight(
            self,
            "reduce_scatter",
            work,
            shard,
            keep=wire,
            finish=lambda out: out.to(full.dtype).div_(self.world_size),
        )

    @_collective
    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a small (CPU) tensor over ranks; where only NCCL serves the group, which reduces GPU
        tensors only, it travels there."""
        if self.world_size == 1:
            return value
        if not reduces_cpu_tensors(dist.get_backend()):
            on_gpu = value.to(self.device)
            dist.all_reduce(on_gpu)
            return on_gpu.cpu()
        dist.all_reduce(value)
        return value

    # -- small control messages (checkpoint commits, agreement, metrics) ---------------------------

    @_collective
    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank passed `ok=True` (each rank learns of the others' failures)."""
        if self.world_size == 1:
            return ok
        return (
            int(self.all_reduce_sum(torch.tensor([0 if ok else 1], dtype=torch.int64)).item()) == 0
        )

    def mean(self, values: list[float]) -> list[float]:
        """The mean over ranks of each value (fp64, so a one-rank mean is the value itself)."""
        if self.world_size == 1:
            return values
        total = self.all_reduce_sum(torch.tensor(values, dtype=torch.float64))
        return (total / self.world_size).tolist()

    def total(self, values: list[float]) -> list[float]:
        """The sum over ranks of each value (fp64: integer counts below 2**53 stay exact)."""
        if self.world_size == 1:
            return values
        return self.all_reduce_sum(torch.tensor(values, dtype=torch.float64)).tolist()

    @_collective
    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able `obj`, in rank order. JSON rather than pickle: nothing a peer
        sends is ever unpickled."""
        if self.world_size == 1:
            return [obj]
        raw = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        sizes = self._gather_cpu(torch.tensor([raw.numel()], dtype=torch.int64))
        longest = int(sizes.max().item())
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: raw.numel()] = raw
        rows = self._gather_cpu(padded).view(self.world_size, longest)
        return [
            json.loads(bytes(rows[r, : int(sizes[r])].tolist())) for r in range(self.world_size)
        ]

    def broadcast_json(self, obj: Any) -> Any:
        """Rank 0's JSON-able `obj` on every rank."""
        return self.all_gather_json(obj if self.rank == 0 else None)[0]

    def _gather_cpu(self, value: torch.Tensor) -> torch.Tensor:
        """all_gather of a small CPU tensor (through the GPU where no backend serves the CPU)."""
        device = value.device if reduces_cpu_tensors(dist.get_backend()) else self.device
        out = torch.empty(value.numel() * self.world_size, dtype=value.dtype, device=device)
        all_gather_tensor(out, value.to(device))
        return out.cpu()


class InFlight:
    """One collective in flight: its work handle, the buffer it fills, and the input it must
    keep alive until then. `wait()` is the sync point (the host on gloo, the current stream on
    NCCL) and returns the result; a second `wait()` returns it again."""

    def __init__(
        self,
        comm: Comm,
        what: str,
        work: Any,
        out: torch.Tensor,
        keep: torch.Tensor | None = None,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.comm = comm
        self.what = what
        self.work = work
        self.out = out
        self.keep = keep
        self.finish = finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as e:
                raise _lost(self.comm, self.what, e) from None
            self.work, self.keep = None, None
            if self.finish is not None:
                self.out, self.finish = self.finish(self.out), None
        return self.out
