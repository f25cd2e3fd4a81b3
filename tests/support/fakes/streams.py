"""A recording fake of `tierzero.engine.runtime.streams.Streams` for CPU tests of the copy pipeline.

It behaves like a GPU that runs copies late: a copy on `h2d` or `d2h` takes its source as it is
when issued, fills its destination with NaN bytes, and writes the source into it only when
something waits for the copy's event (`wait`, a copy's `after`, `host_wait`). Compute and host
code that read a destination before waiting for its copy's event therefore read NaN, and the
run stops being bitwise equal to plain PyTorch. Compute is synchronous (the CPU runs it as it is
issued), so a compute event has always happened. Every call is logged, with the device pool's
give-backs (`tests.support.watchers.watch_device_pool`), for the invariants `tests.support.checks`
reads from the log.

It also keeps, per stream, which other streams' copies it is ordered after (through the events
it waited for, transitively), and logs a hazard when a copy reads or writes bytes that a copy on
another stream writes (or reads) without that order: a hazard a real GPU would race on even
where the fake's late landing happened to hide it.

What a real GPU would do that the fake's landing makes visible, each logged as a hazard:
- a copy reads its source when it runs, not when it is issued: it lands the source as it is at
  landing, and a source that host code changed while the copy was in flight is named;
- a destination host code wrote while its copy was in flight (the late copy overwrites it);
- a host pool block handed out while a copy still reads or writes it
  (`tests.support.watchers.watch_host_pool`);
- allocator memory used on another stream without `keep_alive` (record_stream) there
  (`tests.support.checks.check_allocator_memory_kept_alive`).
- a collective (`collective`; `tests.support.fakes.comm.nccl_like_collectives` routes the
  engine's through it, for two gloo ranks) runs on its own `comm` stream after what the issuing
  stream has queued: its output is NaN until something waits for its event, and an input changed
  before then, an input another stream's copy writes unordered, and a collective never waited for
  are named.
Compute events have happened only once the host synchronised with one at or after them
(`host_wait`), as on a GPU whose kernels run behind the host.

The engine's `Streams` knows nothing of this fake: what production code would have to ask of a
fake's event (which waiter thread it goes to, `lane`), the fake answers itself.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from tierzero.engine.runtime.streams import Streams

_ids = itertools.count()


@dataclass(frozen=True, eq=False)
class FakeEvent:
    stream: str
    seq: int  # copies issued to `stream` before it was recorded
    known: dict[str, int] = field(default_factory=dict)  # per stream, the copies done before it
    id: int = field(default_factory=lambda: next(_ids))


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(
        torch.equal(a, b)
        or (
            a.is_floating_point()
            and torch.equal(a.isnan(), b.isnan())
            and torch.equal(a.nan_to_num(), b.nan_to_num())
        )
    )


class RecordingStreams(Streams):
    """`separate_writes`: host -> device writes on their own `h2d_write` stream and waiting
    activations on `h2d_act`, as on a GPU (by default both share `h2d`, which orders them after
    fetches)."""

    separate = True
    compute, h2d, d2h, comm = "compute", "h2d", "d2h", "comm"

    def __init__(self, separate_writes: bool = False) -> None:
        self.device = torch.device("cpu")
        self.log: list[tuple] = []
        self._lock = threading.RLock()
        self._writes = "h2d_write" if separate_writes else "h2d"
        self._acts = "h2d_act" if separate_writes else "h2d"
        self.log.append(("writes_on", self._writes))
        self._issued = {s: 0 for s in ("compute", "h2d", "d2h", "comm", self._writes, self._acts)}
        self._done = dict(self._issued)
        self._queue: dict[str, deque] = {s: deque() for s in self._issued if s != "compute"}
        # stream -> what it is ordered after
        self._known = {s: dict(self._issued) for s in self._issued}
        self._copies: dict[str, list] = {s: [] for s in self._issued}  # stream -> (dst, src) by seq
        # copies the host has seen finish (host_wait, query): anything issued later is after them
        self._finished = dict(self._issued)
        # the device pool's blocks (`watch_device_pool`)
        self.device_spans: set[tuple[int, int]] = set()
        self._compute_marks = 0  # compute events recorded so far
        self._compute_synced = 0  # the latest compute event the host synchronised with
        self._current = threading.local()  # the stream `current` made current on this thread

    @property
    def h2d_write(self) -> str:
        return self._writes

    @property
    def h2d_act(self) -> str:
        return self._acts

    def current(self, stream: str):
        return _Current(self._current, stream)

    def lane(self, event: FakeEvent | None) -> str:
        """One waiter thread per stream, as `CudaStreams` has: the event names its stream."""
        return event.stream if event is not None else "copy"

    def current_stream(self) -> str:
        """The calling thread's current stream: compute unless `current` says otherwise."""
        return getattr(self._current, "stream", self.compute)

    def record(self, stream: str) -> FakeEvent:
        with self._lock:
            self._order_after(stream, self._finished)
            event = FakeEvent(stream, self._issued[stream], dict(self._known[stream]))
            if stream == self.compute:
                self._compute_marks += 1
                object.__setattr__(event, "mark", self._compute_marks)
            self.log.append(("record", stream, event))
            return event

    def wait(self, stream: str, event: FakeEvent | None) -> None:
        with self._lock:
            self.log.append(("wait", stream, event))
            self._order_after(stream, event)
            self._run_until(event)

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, stream: str, after: FakeEvent | None = None
    ) -> FakeEvent:
        with self._lock:
            self._order_after(stream, after)
            self._order_after(stream, self._finished)
            self._check_hazards(stream, _span(dst), _span(src))
            # the stream runs the copy after `after`: what it waited for is done
            self._run_until(after)
            self._issued[stream] += 1
            self._known[stream][stream] = self._issued[stream]
            # the tensors themselves, so their memory is not reused while the log refers to it
            # (on a GPU, `keep_alive` does that for the allocator's tensors)
            self._copies[stream].append((dst, src))
            if stream == self.compute:
                dst.copy_(src)
                self._done[stream] = self._issued[stream]
            else:
                self._queue[stream].append(
                    (self._issued[stream], dst, src, src, src.detach().clone())
                )
                dst.view(torch.uint8).fill_(0xFF)  # NaN until the copy's event is waited for
            event = FakeEvent(stream, self._issued[stream], dict(self._known[stream]))
            self.log.append(
                (
                    "copy",
                    stream,
                    dst.data_ptr(),
                    after,
                    threading.current_thread().name,
                    event,
                    src.data_ptr(),
                )
            )
            return event

    def _order_after(self, stream: str, event: FakeEvent | dict[str, int] | None) -> None:
        if event is not None:
            known = self._known[stream]
            for other, seq in (event if isinstance(event, dict) else event.known).items():
                known[other] = max(known[other], seq)

    def _check_hazards(self, stream: str, dst: tuple[int, int], src: tuple[int, int]) -> None:
        for other, copies in self._copies.items():
            if other == stream:
                continue  # a stream runs its own copies in order
            for seq, (w_dst, w_src) in enumerate(
                copies[self._known[stream][other] :], self._known[stream][other] + 1
            ):
                w_dst, w_src = _span(w_dst), _span(w_src)
                for what, hit in (
                    ("reads what", _overlap(w_dst, src)),
                    ("overwrites what", _overlap(w_dst, dst)),
                    ("overwrites what", _overlap(w_src, dst)),
                ):
                    if hit:
                        self.log.append(
                            (
                                "hazard",
                                f"a {stream} copy {what} {other} copy {seq} touches, "
                                "unordered with it",
                            )
                        )

    def collective(self, out: torch.Tensor, result: torch.Tensor, inp: torch.Tensor) -> FakeEvent:
        """An NCCL collective issued now, as NCCL runs one: on `comm`, after everything the
        issuing (current) stream has queued, reading `inp` and filling `out` -- NaN until its
        event is waited for, then `result`, what the ranks' real collective computed from `inp`
        as issued (an input changed before then is named, as a copy's source is). An output
        allocated while `comm` is current is memory for that stream
        (`check_allocator_memory_kept_alive`)."""
        with self._lock:
            issuing = self.current_stream()
            if issuing == self.comm and not self.on_device(out):
                self.log.append(("alloc", self.comm, out.data_ptr()))
            self._order_after(self.comm, self._known[issuing])
            self._order_after(self.comm, self._finished)
            self._check_hazards(self.comm, _span(out), _span(inp))
            self._issued[self.comm] += 1
            seq = self._known[self.comm][self.comm] = self._issued[self.comm]
            self._copies[self.comm].append((out, inp))
            self._queue[self.comm].append((seq, out, result, inp, inp.detach().clone()))
            out.view(torch.uint8).fill_(0xFF)
            event = FakeEvent(self.comm, seq, dict(self._known[self.comm]))
            self.log.append(
                ("collective", issuing, out.data_ptr(), event, threading.current_thread().name)
            )
            return event

    def empty_like(self, tensor: torch.Tensor, stream: str) -> torch.Tensor:
        with self._lock:
            fresh = torch.empty_like(tensor)
            self.log.append(("alloc", stream, fresh.data_ptr()))
            return fresh

    def host_wait(self, event: FakeEvent | None) -> None:
        with self._lock:
            self.log.append(("host_wait", event, threading.current_thread().name))
            self._run_until(event)
            self._finish(event)
            if event is not None and event.stream == self.compute:
                self._compute_synced = max(self._compute_synced, event.mark)

    def query(self, event: FakeEvent | None) -> bool:
        with self._lock:
            if event is not None and event.stream == self.compute:  # kernels run behind the host
                done = event.mark <= self._compute_synced
            else:
                done = event is None or self._done[event.stream] >= event.seq
            if done:
                self._finish(event)
            return done

    def _finish(self, event: FakeEvent | None) -> None:
        if event is not None:
            for other, seq in event.known.items():
                self._finished[other] = max(self._finished[other], seq)

    def keep_alive(self, tensor: torch.Tensor, stream: str) -> None:
        with self._lock:
            self.log.append(("keep_alive", stream, tensor.data_ptr()))

    def _run_until(self, event: FakeEvent | None) -> None:
        if event is None or event.stream == self.compute:
            return
        queue = self._queue[event.stream]
        while queue and queue[0][0] <= event.seq:
            seq, dst, src, read, issued = queue.popleft()
            if not _same(read, issued):
                self.log.append(
                    (
                        "hazard",
                        f"the input of comm collective {seq} was changed while it was in flight"
                        if event.stream == self.comm
                        else f"the source of {event.stream} copy {seq} changed while it was "
                        "in flight",
                    )
                )
            if not self._overlaps_queued(_span(dst)) and not bool(
                (dst.view(torch.uint8) == 0xFF).all()
            ):
                self.log.append(
                    (
                        "hazard",
                        f"the destination of {event.stream} copy {seq} was written while "
                        "it was in flight",
                    )
                )
            dst.copy_(src)  # the source as it is now: a GPU reads it when the copy runs
            self._done[event.stream] = seq

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in device memory (a device pool block, as far as the fake knows)."""
        span = _span(t)
        return any(a <= span[0] < b for a, b in self.device_spans)

    def _overlaps_queued(self, span: tuple[int, int]) -> bool:
        """Whether a copy still in flight reads or writes bytes in `span`."""
        return any(
            _overlap(span, _span(dst)) or _overlap(span, _span(read))
            for queue in self._queue.values()
            for _, dst, _, read, _ in queue
        )


class _Current:
    """`RecordingStreams.current`: `stream` is the thread's current one inside the block."""

    def __init__(self, local: threading.local, stream: str) -> None:
        self.local, self.stream = local, stream

    def __enter__(self) -> None:
        self.previous = getattr(self.local, "stream", None)
        self.local.stream = self.stream

    def __exit__(self, *exc: object) -> None:
        self.local.stream = self.previous if self.previous is not None else "compute"
