"""A device AdamW issued from the optimizer's thread (overlap_step) runs on that thread's current
stream, not autograd's, and reads the grad autograd's stream allocated: it must wait for the
grad's producer there and mark what it read as used on its own stream (`keep_alive`, i.e.
`record_stream`), or the caching allocator may hand the grad's memory to autograd's next
allocation while the step still reads it. No GPU: the streams are a spy with per-thread current
streams (as CUDA's are), and the step itself is recorded, not run."""

from __future__ import annotations

import contextlib
import threading

import torch

from tierzero.config import StateKind
from tierzero.engine.step.optim import ShardOptimizer, Work


class PerThreadStreams:
    """Each thread's current stream is its own default one unless `current` says otherwise."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.log: list[tuple] = []

    @property
    def compute(self) -> str:
        return getattr(self.local, "stream", f"default:{threading.current_thread().name}")

    @contextlib.contextmanager
    def current(self, stream: str):
        before = getattr(self.local, "stream", None)
        self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = (
                before if before is not None else f"default:{threading.current_thread().name}"
            )

    def wait(self, stream: str, event: object) -> None:
        self.log.append(("wait", stream, event))

    def timed(self, link: str, stream: str):
        return contextlib.nullcontext()  # busy time is `test_busy_time`'s

    def keep_alive(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(("keep_alive", stream, tensor.data_ptr()))


def test_the_device_step_waits_for_the_grad_and_keeps_what_it_read_alive_on_its_own_stream() -> (
    None
):
    streams = PerThreadStreams()
    optimizer = ShardOptimizer.__new__(ShardOptimizer)
    # a device step (no CUDA call is made: both are recorded)
    optimizer.device = torch.device("cuda", 0)
    optimizer.tiers = type("Tiers", (), {"streams": streams})()
    optimizer._adamw = lambda work, lr, coef: streams.log.append(("adamw", streams.compute))
    optimizer._cast_param = lambda work: streams.log.append(("cast", streams.compute))
    tensors = {
        kind: torch.zeros(8)
        for kind in (StateKind.GRAD, StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    }
    work = Work(unit=None, piece=0, start=0, end=8, tensors=tensors, produced="grad produced")
    stepper = threading.Thread(target=optimizer._step, args=(work, 1e-3, None), name="optimizer")
    stepper.start()
    stepper.join()
    mine = "default:optimizer"
    assert streams.log[:3] == [("wait", mine, "grad produced"), ("adamw", mine), ("cast", mine)]
    kept = {ptr for op, stream, ptr in streams.log[3:] if op == "keep_alive" and stream == mine}
    assert kept == {t.data_ptr() for t in tensors.values()}
