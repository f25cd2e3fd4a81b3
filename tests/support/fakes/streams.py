"""A recording fake of `tierzero.engine.runtime.streams.Streams` for CPU tests of the copy pipeline.

It behaves like a GPU that runs copies late: a copy on `h2d` or `d2h` takes its source as it is
when issued, fills its destination with NaN bytes, and writes the source into it only when
something waits for the copy's event (`wait`, a copy's `after`, `host_wait`). Compute and host
code that read a destination before waiting for its copy's event therefore read NaN, and the
run stops being bitwise equal to plain PyTorch. Compute is synchronous (the CPU runs it as it is
issued), so a compute event has always happened. Every call is logged, with the device pool's
give-backs (`watch_device_pool`), for the invariants in `check_*` below.

It also keeps, per stream, which other streams' copies it is ordered after (through the events
it waited for, transitively), and logs a hazard when a copy reads or writes bytes that a copy on
another stream writes (or reads) without that order: a hazard a real GPU would race on even
where the fake's late landing happened to hide it.

What a real GPU would do that the fake's landing makes visible, each logged as a hazard:
- a copy reads its source when it runs, not when it is issued: it lands the source as it is at
  landing, and a source that host code changed while the copy was in flight is named;
- a destination host code wrote while its copy was in flight (the late copy overwrites it);
- a host pool block handed out while a copy still reads or writes it (`watch_host_pool`);
- allocator memory used on another stream without `keep_alive` (record_stream) there
  (`check_allocator_memory_kept_alive`).
- a collective (`collective`; `nccl_like_collectives` routes the engine's through it, for
  two gloo ranks) runs on its own `comm` stream after what the issuing stream has queued: its
  output is NaN until something waits for its event, and an input changed before then, an
  input another stream's copy writes unordered, and a collective never waited for are named.
Compute events have happened only once the host synchronised with one at or after them
(`host_wait`), as on a GPU whose kernels run behind the host. `SyncWatch` counts the implicit
synchronisations (`.item()`, `.cpu()`, blocking `.to(device)`, ...) the training thread makes.
"""

from __future__ import annotations

import itertools
import threading
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from torch.overrides import TorchFunctionMode

from tierzero.storage.device import DevicePool
from tierzero.storage.host import HostPool
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
    return bool(torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                      and torch.equal(a.nan_to_num(), b.nan_to_num())))


class RecordingStreams(Streams):
    """`separate_writes`: host -> device writes on their own `h2d_write` stream, as on a GPU
    (by default they share `h2d`, which orders them after fetches)."""

    separate = True
    compute, h2d, d2h, comm = "compute", "h2d", "d2h", "comm"

    def __init__(self, separate_writes: bool = False) -> None:
        self.device = torch.device("cpu")
        self.log: list[tuple] = []
        self._lock = threading.RLock()
        self._writes = "h2d_write" if separate_writes else "h2d"
        self.log.append(("writes_on", self._writes))
        self._issued = {s: 0 for s in ("compute", "h2d", "d2h", "comm", self._writes)}
        self._done = dict(self._issued)
        self._queue: dict[str, deque] = {s: deque() for s in self._issued if s != "compute"}
        self._known = {s: dict(self._issued) for s in self._issued}  # stream -> what it is ordered after
        self._copies: dict[str, list] = {s: [] for s in self._issued}  # stream -> (dst, src) by seq
        # copies the host has seen finish (host_wait, query): anything issued later is after them
        self._finished = dict(self._issued)
        self.device_spans: set[tuple[int, int]] = set()  # the device pool's blocks (`watch_device_pool`)
        self._compute_marks = 0  # compute events recorded so far
        self._compute_synced = 0  # the latest compute event the host synchronised with
        self._current = threading.local()  # the stream `current` made current on this thread

    @property
    def h2d_write(self) -> str:
        return self._writes

    def current(self, stream: str):
        return _Current(self._current, stream)

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

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: str, after: FakeEvent | None = None) -> FakeEvent:
        with self._lock:
            self._order_after(stream, after)
            self._order_after(stream, self._finished)
            self._check_hazards(stream, _span(dst), _span(src))
            self._run_until(after)  # the stream runs the copy after `after`: what it waited for is done
            self._issued[stream] += 1
            self._known[stream][stream] = self._issued[stream]
            # the tensors themselves, so their memory is not reused while the log refers to it
            # (on a GPU, `keep_alive` does that for the allocator's tensors)
            self._copies[stream].append((dst, src))
            if stream == self.compute:
                dst.copy_(src)
                self._done[stream] = self._issued[stream]
            else:
                self._queue[stream].append((self._issued[stream], dst, src, src, src.detach().clone()))
                dst.view(torch.uint8).fill_(0xFF)  # NaN until the copy's event is waited for
            event = FakeEvent(stream, self._issued[stream], dict(self._known[stream]))
            self.log.append(("copy", stream, dst.data_ptr(), after, threading.current_thread().name, event,
                             src.data_ptr()))
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
            for seq, (w_dst, w_src) in enumerate(copies[self._known[stream][other]:], self._known[stream][other] + 1):
                w_dst, w_src = _span(w_dst), _span(w_src)
                for what, hit in (("reads what", _overlap(w_dst, src)), ("overwrites what", _overlap(w_dst, dst)),
                                  ("overwrites what", _overlap(w_src, dst))):
                    if hit:
                        self.log.append(("hazard", f"a {stream} copy {what} {other} copy {seq} touches, "
                                                   "unordered with it"))

    def collective(self, out: torch.Tensor, result: torch.Tensor, inp: torch.Tensor) -> FakeEvent:
        """An NCCL collective issued now, as NCCL runs one: on `comm`, after everything the
        issuing (current) stream has queued, reading `inp` and filling `out` -- NaN until its
        event is waited for, then `result`, what the ranks' real collective computed from `inp`
        as issued (an input changed before then is named, as a copy's source is). An output
        allocated while `comm` is current is memory for that stream (`check_allocator_memory_kept_alive`)."""
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
            self.log.append(("collective", issuing, out.data_ptr(), event, threading.current_thread().name))
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
                self.log.append(("hazard", f"the input of comm collective {seq} was changed while it was in flight"
                                 if event.stream == self.comm else
                                 f"the source of {event.stream} copy {seq} changed while it was in flight"))
            if not self._overlaps_queued(_span(dst)) and not bool((dst.view(torch.uint8) == 0xFF).all()):
                self.log.append(("hazard", f"the destination of {event.stream} copy {seq} was written while "
                                           "it was in flight"))
            dst.copy_(src)  # the source as it is now: a GPU reads it when the copy runs
            self._done[event.stream] = seq

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in device memory (a device pool block, as far as the fake knows)."""
        span = _span(t)
        return any(a <= span[0] < b for a, b in self.device_spans)

    def _overlaps_queued(self, span: tuple[int, int]) -> bool:
        """Whether a copy still in flight reads or writes bytes in `span`."""
        return any(_overlap(span, _span(dst)) or _overlap(span, _span(read))
                   for queue in self._queue.values() for _, dst, _, read, _ in queue)


class _Current:
    """`RecordingStreams.current`: `stream` is the thread's current one inside the block."""

    def __init__(self, local: threading.local, stream: str) -> None:
        self.local, self.stream = local, stream

    def __enter__(self) -> None:
        self.previous = getattr(self.local, "stream", None)
        self.local.stream = self.stream

    def __exit__(self, *exc: object) -> None:
        self.local.stream = self.previous if self.previous is not None else "compute"


class _FakeWork:
    """A collective's work handle: `wait()` makes the current stream wait for it (NCCL's)."""

    def __init__(self, fake: RecordingStreams, event: FakeEvent) -> None:
        self.fake, self.event = fake, event

    def wait(self) -> bool:
        self.fake.wait(self.fake.current_stream(), self.event)
        return True


def nccl_like_collectives(fake: RecordingStreams, patch=setattr) -> None:
    """Route `tierzero.distributed.comm`'s asynchronous all-gathers and reduce-scatters through
    `fake.collective`: the real (gloo) collective runs at issue into a scratch buffer, and the
    output the engine sees lands only when its event is waited for. `patch`: a monkeypatch's
    `setattr` in a test, plain `setattr` in a spawned rank."""
    from tierzero.distributed import comm

    def deferred(real):
        def collective(out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
            if not async_op:
                return real(out, inp)
            result = torch.empty_like(out)
            real(result, inp)
            return _FakeWork(fake, fake.collective(out, result, inp))
        return collective

    patch(comm, "_all_gather", deferred(comm._all_gather))
    patch(comm, "_reduce_scatter", deferred(comm._reduce_scatter))


def watch_device_pool(monkeypatch, fake: RecordingStreams) -> None:
    """Log every lease from a `DevicePool`, every give-back with its `ready` token (the release
    event), and every block it drops (its next block at that address is fresh memory)."""
    lease, give_back, drop = DevicePool.lease, DevicePool.give_back, DevicePool._drop

    def logged_lease(pool: DevicePool, nbytes: int) -> torch.Tensor:
        buf = lease(pool, nbytes)
        with fake._lock:
            fake.log.append(("lease", buf.data_ptr()))
            fake.device_spans.add(_span(buf))
        return buf

    def logged_give_back(pool: DevicePool, buf: torch.Tensor, ready: object | None = None) -> None:
        with fake._lock:
            fake.log.append(("give_back", buf.data_ptr(), ready))
        give_back(pool, buf, ready)

    def logged_drop(pool: DevicePool, block: object) -> None:
        with fake._lock:
            fake.log.append(("drop", block.data.data_ptr()))
        drop(pool, block)

    monkeypatch.setattr(DevicePool, "lease", logged_lease)
    monkeypatch.setattr(DevicePool, "give_back", logged_give_back)
    monkeypatch.setattr(DevicePool, "_drop", logged_drop)


def watch_host_pool(monkeypatch, fake: RecordingStreams) -> None:
    """Log a hazard when the host pool hands out a block that a copy in flight still reads or
    writes: its holder gave it back before the copy's event (the pool has no `ready` token)."""
    lease = HostPool.lease

    def checked_lease(pool: HostPool, nbytes: int, grow: bool = True) -> torch.Tensor:
        buf = lease(pool, nbytes, grow)
        with fake._lock:
            if fake._overlaps_queued(_span(buf)):
                fake.log.append(("hazard", f"the host pool hands out 0x{buf.data_ptr():x} while a copy "
                                           "still uses it"))
        return buf

    monkeypatch.setattr(HostPool, "lease", checked_lease)


_SYNCING = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "nonzero"}


class SyncWatch(TorchFunctionMode):
    """Count the calls that make the host wait for the device (on a GPU), while active on the
    training thread: reading a value (`.item()`, `.tolist()`, `bool(t)`, `.nonzero()`),
    `.cpu()`, a `.to(device)` that is not `non_blocking` (from pageable memory even that
    blocks), and a blocking `.copy_()` into or out of device memory (`fake.device_spans`: the
    device pool's blocks). On the CPU every tensor is host memory, so the watch tells host
    values apart by where they came from: what `.cpu()` returns (a copy, as from a GPU) and what
    is computed from such values alone are host values, and reading them is not counted. `where`
    names the tierzero file and line of each counted call."""

    def __init__(self, fake: RecordingStreams) -> None:
        super().__init__()
        self.fake = fake
        self.where: list[str] = []
        self.host: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else [a])
                  if isinstance(t, torch.Tensor)]
        on_host = bool(inputs) and all(t in self.host for t in inputs)
        if (name in _SYNCING and not on_host or name == "to" and _moves(args, kwargs)
                or name == "copy_" and self._device_copy(args, kwargs)):
            caller = _caller()
            if caller is not None:
                self.where.append(f"{name} at {caller}")
        out = func(*args, **kwargs)
        if name == "cpu":
            out = out.clone()  # a new host tensor, as from a GPU
        if on_host or name == "cpu":
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.host.add(t)
        return out

    def _device_copy(self, args: tuple, kwargs: dict) -> bool:
        if kwargs.get("non_blocking") or len(args) > 2 and args[2]:
            return False
        return any(isinstance(t, torch.Tensor) and self.fake.on_device(t) for t in args[:2])


def _moves(args: tuple, kwargs: dict) -> bool:
    """Whether a `.to(...)` names a device (or a tensor to follow) and may block."""
    if kwargs.get("non_blocking") or any(a is True for a in args[2:]):
        return False
    return any(isinstance(a, (torch.device, torch.Tensor, str)) for a in [*args[1:], kwargs.get("device")])


def _caller() -> str | None:
    """The tierzero line that made the call; None when the fake itself made it."""
    for frame in reversed(traceback.extract_stack(limit=16)[:-2]):
        name = frame.filename
        if "/tests/support/" in name:
            return None
        if "/torch/" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "torch"


def check_h2d_copies_wait_only_for_their_buffer(log: list[tuple]) -> list[str]:
    """A copy into a device buffer that was given back waits for the event it was given back
    with (its release) and for nothing else; the h2d stream never waits outside a copy."""
    problems, released = [], {}
    for entry in log:
        if entry[0] == "give_back":
            released[entry[1]] = entry[2]
        elif entry[0] == "drop":
            released.pop(entry[1], None)
        elif entry[0] == "copy" and entry[1] == "h2d" and entry[2] in released:
            ready = released.pop(entry[2])
            if entry[3] is not ready:
                problems.append(f"h2d copy into 0x{entry[2]:x} waits for {entry[3]}, not its release {ready}")
        elif entry[0] == "wait" and entry[1] == "h2d":
            problems.append(f"the h2d stream waits for {entry[2]} outside a copy")
    return problems


def check_no_host_wait_on_compute(log: list[tuple]) -> list[str]:
    """The host never waits for the compute stream (that is a device synchronisation)."""
    return [f"host waits for compute event {e[1]} on thread {e[2]}"
            for e in log if e[0] == "host_wait" and e[1] is not None and e[1].stream == "compute"]


def check_collectives_waited_for(log: list[tuple]) -> list[str]:
    """Every collective's output was waited for (by a stream or the host) before the run ended:
    one never waited for was read unordered with it, or not at all."""
    waited = {e[2].known.get("comm", 0) for e in log if e[0] == "wait" and e[2] is not None}
    waited |= {e[1].known.get("comm", 0) for e in log if e[0] == "host_wait" and e[1] is not None}
    latest = max(waited, default=0)
    return [f"comm collective {e[3].seq} (issued on {e[1]}) was never waited for" for e in log
            if e[0] == "collective" and e[3].seq > latest]


def check_no_copy_hazards(log: list[tuple]) -> list[str]:
    """No copy touches bytes another stream's copy writes (or reads) without waiting for it."""
    return [e[1] for e in log if e[0] == "hazard"]


def check_d2h_copies_wait_for_their_source(log: list[tuple]) -> list[str]:
    """A grad copied to the host waits for the compute event that produced it."""
    return [f"d2h copy into 0x{e[2]:x} does not wait for compute" for e in log
            if e[0] == "copy" and e[1] == "d2h" and (e[3] is None or e[3].stream != "compute")]


_H2D = ("h2d", "h2d_write")  # the host -> device streams (one where writes share h2d)


def check_h2d_copies_write_pool_or_h2d_memory(log: list[tuple]) -> list[str]:
    """Every h2d (or h2d_write) copy fills a buffer just leased from the device pool (ordered by
    its release event) or memory allocated for a host -> device stream (`Streams.empty_like`):
    memory torch's allocator hands out on compute may still be read by compute's queued kernels.
    A copy into a store that compute reads in place (params homed on the device) waits for
    compute instead."""
    problems, fresh = [], set()
    for entry in log:
        if entry[0] == "lease" or entry[0] == "alloc" and entry[1] in _H2D:
            fresh.add(entry[-1])
        elif entry[0] == "copy" and entry[1] in _H2D:
            if entry[2] not in fresh and (entry[3] is None or entry[3].stream != "compute"):
                problems.append(f"h2d copy into 0x{entry[2]:x}: neither a device pool buffer nor "
                                "memory allocated for the h2d stream")
            fresh.discard(entry[2])
    return problems


def check_no_host_wait_on_io_threads(log: list[tuple]) -> list[str]:
    """No I/O worker (nor the loop's thread) sleeps on an event: that is the waiter's job
    (`IOLoop.wait_off_workers`), so NVMe reads and the CPU optimizer never queue behind a wait."""
    return [f"{e[2]} waits for {e[1]}" for e in log
            if e[0] == "host_wait" and e[1] is not None and e[2].startswith("tierzero-io")]


def check_allocator_memory_kept_alive(log: list[tuple], device_spans: set[tuple[int, int]]) -> list[str]:
    """Memory torch's caching allocator owns, used on a stream other than the one it was
    allocated on, is `keep_alive`d there (`record_stream` on a GPU), or the allocator may hand
    it out again while that stream still reads it: a d2h copy's source outside the device
    pool's blocks (a grad autograd allocated on compute) for the d2h stream, and memory
    allocated for the h2d stream (which compute then reads) for compute."""
    kept = {(e[2], e[1]) for e in log if e[0] == "keep_alive"}
    problems = [f"d2h copy from 0x{e[6]:x} (allocator memory) without keep_alive on d2h" for e in log
                if e[0] == "copy" and e[1] == "d2h" and (e[6], "d2h") not in kept
                and not any(a <= e[6] < b for a, b in device_spans)]
    return problems + [f"memory allocated for {e[1]} at 0x{e[2]:x} never kept alive for compute" for e in log
                       if e[0] == "alloc" and e[1] != "compute" and (e[2], "compute") not in kept]


def check_writes_into_read_before_waited(log: list[tuple], spans: list[tuple[int, int]]) -> list[str]:
    """Memory that compute reads in place (`spans`: params homed on the device) is written by
    copies on the host -> device write stream (`h2d_write`, h2d itself where the fake has one),
    never a blocking copy; each waits for compute (which may still read the old values), and
    the compute stream itself waits for its event, not only the host."""
    problems, unwaited, writes = [], {}, "h2d"
    for entry in log:
        if entry[0] == "writes_on":
            writes = entry[1]
        elif entry[0] == "copy" and entry[1] in _H2D and any(a <= entry[2] < b for a, b in spans):
            if entry[1] != writes:
                problems.append(f"a write into 0x{entry[2]:x} on {entry[1]}, not the {writes} stream")
            if entry[3] is None or entry[3].stream != "compute":
                problems.append(f"{entry[1]} write into 0x{entry[2]:x} waits for {entry[3]}, not compute")
            unwaited[(entry[1], entry[5].seq)] = entry[2]
        elif entry[0] == "wait" and entry[1] == "compute" and entry[2] is not None:
            known = entry[2].known
            unwaited = {(s, seq): ptr for (s, seq), ptr in unwaited.items() if seq > known.get(s, 0)}
    if spans and not any(e[0] == "copy" and e[1] in _H2D and any(a <= e[2] < b for a, b in spans) for e in log):
        problems.append("nothing was written into the spans on a host -> device stream (a blocking copy?)")
    return problems + [f"compute never waits for the h2d write into 0x{ptr:x}" for ptr in unwaited.values()]
