"""The recording fake with a simulated clock (`fakes.clock`): it keeps every invariant the
recording fake checks and adds what a GPU's timing shows.

- Copies take their bytes over the link's bandwidth on their stream's FIFO; kernels issued while
  `kernels` is active on a thread take their FLOPs over the device's rate, on that thread's
  current stream (`current`; compute unless a block made another current), as CUDA runs a
  thread's kernels on its current stream.
- `watch_disk` puts the NVMe store's reads and writes on the drive's queue, and makes a thread
  that blocks on the I/O loop (`Tiers.run`) wait, on the clock, for the disk work that finished
  meanwhile: waits outside the streams' interface cost time too.
- Reuse: memory torch's allocator owns that a copy on another stream reads is watched; if the
  engine drops its last reference before anything waited for the copy and without `keep_alive`
  on that stream, the caching allocator could hand the storage out again while the stream still
  reads it, and that is logged (`("reuse", ...)`, read by `checks.check_no_reuse_in_flight`).

The clock is computed from the ops the engine issues; nothing in it is a fixed answer.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from dataclasses import dataclass

import torch
from tierzero.storage.base import aligned_empty
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from tests.support.fakes.clock import Rates, Scale, SimClock
from tests.support.fakes.streams import FakeEvent, RecordingStreams, _span

# copies of activations and batches
_ACTIVATION_FILES = ("vertical/boundary.py", "runtime/batch.py")
_ACTIVATION_KEYS = ("act/",)  # the waiting activations' arrays on NVMe


def _thread() -> str:
    return threading.current_thread().name


def _storage_refs(t: torch.Tensor) -> int:
    """How many tensors share `t`'s storage (the count includes the query's own handle)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@dataclass(eq=False)
class _Read:
    """Allocator memory a copy on `stream` reads until `event` is waited for."""

    src: torch.Tensor
    stream: str
    event: FakeEvent
    kept: bool = False


class TimedStreams(RecordingStreams):
    """`separate_writes` as for the recording fake (on by default: as on a GPU)."""

    def __init__(
        self, rates: Rates = Rates(), scale: Scale = Scale(), separate_writes: bool = True
    ) -> None:
        super().__init__(separate_writes)
        self.clock = SimClock(rates)
        self.scale = scale
        self.kernels = KernelClock(self)
        self._reads: list[_Read] = []
        self._kept: set[tuple[int, str]] = set()
        # ids of the tensors the fake's logs keep (alive: ids stay unique)
        self._held: set[int] = set()
        self._held_on: Counter[int] = Counter()  # storage -> how many of those tensors are on it

    def record(self, stream: str) -> FakeEvent:
        with self._lock:
            event = super().record(stream)
            object.__setattr__(event, "at", self.clock.record(stream, _thread()))
            return event

    def wait(self, stream: str, event: FakeEvent | None) -> None:
        with self._lock:
            super().wait(stream, event)
            if event is not None:
                self.clock.wait(stream, event.at, _thread())
                self._waited(event)

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, stream: str, after: FakeEvent | None = None
    ) -> FakeEvent:
        with self._lock:
            self._check_reuse()
            event = super().copy(dst, src, stream, after)
            self._hold(dst, src)
            activation = any(
                f.filename.endswith(_ACTIVATION_FILES) for f in traceback.extract_stack(limit=8)
            )
            scale = self.scale.activation_bytes if activation else self.scale.state_bytes
            at = self.clock.copy(
                stream,
                _span(dst),
                _span(src),
                src.numel() * src.element_size() * scale,
                getattr(after, "at", 0.0),
                _thread(),
                "activation" if activation else "state",
            )
            object.__setattr__(event, "at", at)
            if stream != self.compute and not self.on_device(src):
                self._reads.append(
                    _Read(src, stream, event, (src.data_ptr(), stream) in self._kept)
                )
            return event

    def collective(self, out: torch.Tensor, result: torch.Tensor, inp: torch.Tensor) -> FakeEvent:
        with self._lock:
            event = super().collective(out, result, inp)
            self._hold(out, result, inp)
            object.__setattr__(event, "at", self.clock.record(self.comm, _thread()))
            return event

    def host_wait(self, event: FakeEvent | None) -> None:
        with self._lock:
            super().host_wait(event)
            if event is not None:
                self.clock.advance_host(_thread(), event.at)
                self._waited(event)

    def keep_alive(self, tensor: torch.Tensor, stream: str) -> None:
        with self._lock:
            super().keep_alive(tensor, stream)
            self._kept.add((tensor.data_ptr(), stream))
            for read in self._reads:
                if read.stream == stream and read.src.data_ptr() == tensor.data_ptr():
                    read.kept = True

    def charge(self, flops: float, what: str) -> None:
        """A kernel of `flops` issued by the calling thread on its current stream."""
        with self._lock:
            self._check_reuse()
            self.clock.kernel(self.current_stream(), flops * self.scale.flops, _thread(), what)

    def _waited(self, event: FakeEvent) -> None:
        """Copies ordered before `event` are done: the memory they read is free to go."""
        self._reads = [r for r in self._reads if r.event.seq > event.known.get(r.stream, 0)]

    def _hold(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            if id(tensor) not in self._held:
                self._held.add(id(tensor))
                self._held_on[tensor.untyped_storage().data_ptr()] += 1

    def _check_reuse(self) -> None:
        """A watched source whose last reference outside the fake is gone while its copy was not
        yet waited for, and that was not kept alive on the copy's stream."""
        for read in list(self._reads):
            held = self._held_on[read.src.untyped_storage().data_ptr()]
            if _storage_refs(read.src) <= 1 + held:  # 1: the query's own handle
                self._reads.remove(read)
                if not read.kept:
                    self.log.append(
                        (
                            "reuse",
                            read.stream,
                            read.src.data_ptr(),
                            f"memory at 0x{read.src.data_ptr():x} freed while {read.stream} copy "
                            f"{read.event.seq} still reads it, without keep_alive there",
                        )
                    )


class KernelClock(TorchDispatchMode):
    """Charge each kernel the calling thread runs (inside `with fake.kernels:`) to its current
    stream: FLOPs as `torch.utils.flop_counter` counts them. Autograd runs a CPU graph's backward
    on the thread that called it, under the same mode."""

    def __init__(self, fake: TimedStreams) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.fake.charge(count(*args, **kwargs, out_val=out), str(func._overloadpacket))
        return out


def watch_disk(monkeypatch, fake: TimedStreams) -> None:
    """Put `NvmeStore` reads and writes on the clock's drive queue (scaled as state or activation
    bytes by their key), and make a thread blocked in `Tiers.run` wait, on the clock, for disk
    work done meanwhile. The waiting activations' buffers are page-aligned host memory, unpinned:
    there is no CUDA runtime to pin with (pinning itself is `fakes.pinning`'s to test)."""
    from tierzero.storage.nvme.store import NvmeStore

    from tierzero.engine.runtime.tiers import Tiers
    from tierzero.engine.vertical import boundary

    read_into, write, run = NvmeStore.read_into, NvmeStore.write, Tiers.run

    def nbytes(key: str, t: torch.Tensor) -> float:
        scale = (
            fake.scale.activation_bytes
            if key.startswith(_ACTIVATION_KEYS)
            else fake.scale.state_bytes
        )
        return t.numel() * t.element_size() * scale

    async def timed_read(store, key: str, out: torch.Tensor, *args, **kw) -> None:
        await read_into(store, key, out, *args, **kw)
        with fake._lock:
            fake.clock.disk("read", _span(out), nbytes(key, out), _thread())

    async def timed_write(store, key: str, src: torch.Tensor) -> None:
        with fake._lock:
            fake.clock.disk("write", _span(src), nbytes(key, src), _thread())
        await write(store, key, src)

    def timed_run(tiers, coro):
        seen = len(fake.clock.ops)
        try:
            return run(tiers, coro)
        finally:
            with fake._lock:
                done = [op.end for op in fake.clock.ops[seen:] if op.resource == "disk"]
                fake.clock.advance_host(_thread(), max(done, default=0.0))

    monkeypatch.setattr(
        boundary, "pinned_empty", lambda nbytes, device=None: aligned_empty(nbytes, torch.uint8)
    )
    monkeypatch.setattr(NvmeStore, "read_into", timed_read)
    monkeypatch.setattr(NvmeStore, "write", timed_write)
    monkeypatch.setattr(Tiers, "run", timed_run)
