"""Streams, events and copies: the one interface the engine's copy pipeline is written against.

Six streams per compute device: `compute` (the current stream of the thread issuing compute), `h2d`
(param fetches host -> device, nothing else, so a prefetch never queues behind a write), `h2d_write`
(the optimizer's writes into device homes and earlier micro-batches' grad sums coming back),
`h2d_act` (batches, and the vertical schedule's waiting activations coming back), `d2h` (grads
device -> host) and `comm`, current while collectives are issued ahead of their use (NCCL runs them
on its own stream, ordered after what the issuing stream has queued: `comm` waits only for the
events the collective needs, never for compute). Every cross-stream dependency is an event: a copy
waits only for the event that frees its destination (its buffer's release, or the compute event that
produced its source), compute waits for a copy's event before it reads the destination, and host
code waits (`host_wait`) for a D2H copy's event before it reads the piece. Nothing here synchronises
a whole stream or device. Host waits go to one waiter thread per stream (`lane`), so a wait for a
d2h copy never sits behind one for an h2d copy.

`CudaStreams` runs this on a GPU, every call bound to its device (`cuda:k`), so work issued from
the I/O loop's threads never lands on the thread's current device (cuda:0) or creates a stray
context there. `CpuStreams` is the same discipline on the CPU device: copies are synchronous, so
every event has already happened. Tests replace both with a recording fake
(`tests/support/fakes/streams.py`) that defers copies until their event is waited for.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from tierzero.config import bound_device
from tierzero.engine.runtime.busy import BusyLog
from tierzero.planning.placement import Link

Event = Any  # torch.cuda.Event, None on the CPU (already happened), or a fake's record
Stream = Any  # torch.cuda.Stream, or a name


class Streams(abc.ABC):
    """The copy engine's streams on one compute device."""

    device: torch.device
    separate: bool  # device memory is not host memory: copies between them are real transfers
    compute: Stream
    h2d: Stream
    d2h: Stream
    comm: Stream
    busy: BusyLog | None = None  # given one, each host<->device copy's interval goes to its link

    @abc.abstractmethod
    def record(self, stream: Stream) -> Event:
        """An event at `stream`'s current position (after everything issued to it so far)."""

    @abc.abstractmethod
    def wait(self, stream: Stream, event: Event) -> None:
        """Make `stream`'s later work wait for `event`, on the device (the host does not block)."""

    def timed(self, link: str, stream: Stream) -> contextlib.AbstractContextManager:
        """Time the work issued to `stream` inside the block as one operation on `link` (on
        the CPU the work runs while the block does)."""
        return self.busy.timed(link) if self.busy is not None else contextlib.nullcontext()

    @abc.abstractmethod
    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, stream: Stream, after: Event = None
    ) -> Event:
        """Copy `src` into `dst` on `stream` once `after` has happened; the copy's event.

        The caller keeps both buffers alive and unused until the event (`keep_alive` for a
        source torch's caching allocator owns)."""

    @abc.abstractmethod
    def empty_like(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        """An uninitialised tensor like `tensor` for a copy on `stream` to fill.

        Allocated while `stream` is current: torch's caching allocator reuses memory freed on a
        stream only for that stream, so a copy on `stream` never overwrites memory that compute
        freed while its queued kernels still read it. A reader on another stream must
        `keep_alive` it there."""

    @abc.abstractmethod
    def host_wait(self, event: Event) -> None:
        """Block the calling thread (any thread) until `event` has happened."""

    @abc.abstractmethod
    def query(self, event: Event) -> bool:
        """Whether `event` has happened (never blocks)."""

    @abc.abstractmethod
    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Keep an allocator-owned `tensor` from being reused before `stream`'s work on it ends."""

    @property
    def store_copy(self) -> torch.cuda.Stream | None:
        """The stream the memory stores copy on (their awaited copies between host and device);
        None where there is no device stream: a store then makes its own if it ever needs one."""
        return None

    @property
    def h2d_write(self) -> Stream:
        """The stream for host -> device writes (see the module docstring); `h2d` itself where
        there is only one (the CPU, the recording fake), which orders them after fetches."""
        return self.h2d

    @property
    def h2d_act(self) -> Stream:
        """The stream batches and waiting activations (the vertical schedule's, one ahead of
        their use) go to the device on, behind neither fetches gated on buffer releases nor the
        optimizer's writes; `h2d_write` where there is no such stream."""
        return self.h2d_write

    def lane(self, event: Event) -> str:
        """The stream `event` is on, naming the waiter thread that waits for it on the host;
        one lane for every copy where events name no stream (they have already happened)."""
        return "copy"

    def current(self, stream: Stream) -> contextlib.AbstractContextManager:
        """Make `stream` the current one while work is issued (a collective ahead of compute);
        where copies are synchronous there is nothing to order."""
        return contextlib.nullcontext()


class CpuStreams(Streams):
    """The CPU device: one memory, synchronous copies, events that have always happened."""

    separate = False
    compute, h2d, d2h, comm = "compute", "h2d", "d2h", "comm"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def record(self, stream: Stream) -> Event:
        return None

    def wait(self, stream: Stream, event: Event) -> None:
        pass

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, stream: Stream, after: Event = None
    ) -> Event:
        if self.busy is None or stream == self.compute:
            dst.copy_(src)
            return None
        with self.busy.timed((Link.GPU_TO_HOST if stream == self.d2h else Link.HOST_TO_GPU).value):
            dst.copy_(src)  # synchronous: the copy runs while the block does
        return None

    def empty_like(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        return torch.empty_like(tensor)

    def host_wait(self, event: Event) -> None:
        pass

    def query(self, event: Event) -> bool:
        return True

    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None:
        pass


class CudaStreams(Streams):
    """Streams and events on `cuda:k`; every call binds the device first (see module docstring)."""

    separate = True

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"CudaStreams needs a device with an index (cuda:k), got {device}")
        self.device = device
        with torch.cuda.device(device):
            self.h2d = torch.cuda.Stream(device)
            self._h2d_write = torch.cuda.Stream(device)
            self._h2d_act = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
            self.comm = torch.cuda.Stream(device)
            self._store_copy = torch.cuda.Stream(device)
        self._lanes = {
            self.h2d: "h2d",
            self._h2d_write: "h2d_write",
            self._h2d_act: "h2d_act",
            self.d2h: "d2h",
            self.comm: "comm",
        }

    @property
    def h2d_write(self) -> Stream:
        return self._h2d_write

    @property
    def h2d_act(self) -> Stream:
        return self._h2d_act

    @property
    def store_copy(self) -> torch.cuda.Stream:
        return self._store_copy

    def lane(self, event: Event) -> str:
        return getattr(event, "lane", "compute")  # `copy` names the events it returns

    @property
    def compute(self) -> Stream:
        """The calling thread's current stream on the device: where the training thread issues
        forward and autograd's thread the backward of each op (autograd runs an op's backward on
        the stream its forward ran on), not a stream captured once at open, so a loop that
        computes inside `torch.cuda.stream(s)` is followed. Only compute-issuing threads ask."""
        return torch.cuda.current_stream(self.device)

    def record(self, stream: Stream) -> Event:
        with torch.cuda.device(self.device):
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def wait(self, stream: Stream, event: Event) -> None:
        if event is not None:
            with torch.cuda.device(self.device):
                stream.wait_event(event)

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, stream: Stream, after: Event = None
    ) -> Event:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            link = _link(src, dst) if self.busy is not None else None
            if link is not None:  # timed on the stream: the copy runs between the two events
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
            # asynchronous only between device memory and pinned host memory (the pools' blocks)
            dst.copy_(src, non_blocking=True)
            # blocking: a thread that waits for a copy sleeps instead of spinning on a core the
            # CPU optimizer needs (copy events are the ones host code waits for)
            event = torch.cuda.Event(blocking=True, enable_timing=link is not None)
            event.record(stream)
        if link is not None:
            self.busy.add_events(link, start, event)
        event.lane = self._lanes.get(stream, "compute")
        return event

    @contextlib.contextmanager
    def timed(self, link: str, stream: Stream) -> Iterator[None]:
        if self.busy is None:
            yield
            return
        with torch.cuda.device(self.device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
        self.busy.add_events(link, start, end)

    def empty_like(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            return torch.empty_like(tensor)

    def host_wait(self, event: Event) -> None:
        if event is not None:
            with torch.cuda.device(self.device):
                event.synchronize()  # host sync point, on this one event only

    def query(self, event: Event) -> bool:
        if event is None:
            return True
        with torch.cuda.device(self.device):
            return event.query()

    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)

    @contextlib.contextmanager
    def current(self, stream: Stream) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield


def _link(src: torch.Tensor, dst: torch.Tensor) -> str | None:
    """The host<->device link a copy uses; None for a copy within one memory."""
    if src.is_cuda == dst.is_cuda:
        return None
    return (Link.GPU_TO_HOST if src.is_cuda else Link.HOST_TO_GPU).value


def bind_thread(device: torch.device) -> None:
    """Make `device` the calling thread's current one (the I/O loop's threads run this first):
    torch code that uses the current device, such as `torch.optim.AdamW.step()`'s
    `current_stream()`, then never creates a context on cuda:0. Nothing to bind on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def open_streams(device: torch.device) -> Streams:
    """The streams of the compute device `device` (tests replace this function)."""
    device = bound_device(device)
    return CudaStreams(device) if device.type == "cuda" else CpuStreams(device)
