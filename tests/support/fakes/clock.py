"""A simulated clock for the stream fake: what a GPU would spend on what the engine issued.

Every resource keeps the time it is busy until: each stream (a FIFO: an op starts once the
previous one on it ended), the disk (one queue for reads and writes), and each host thread (the
host is taken to issue work in no time; it only loses time where it waits: `host_wait`, or a
blocking call the watchers name). An op starts when its stream is free and it is ready: issued
by its thread, after the event it waits for, and after the bytes it reads were written (by a
copy or a disk read) and the bytes it overwrites were last used. It then takes

- a copy: `nbytes` over its link's bandwidth (h2d, d2h; a copy on compute at HBM bandwidth),
- a kernel: its FLOPs over the device's rate (`torch.utils.flop_counter`'s count, so matmuls
  and attention; elementwise kernels are taken as free),
- a disk read or write: `nbytes` over the drive's rate.

Copies on streams that share a direction of the PCIe link (`h2d`, `h2d_write`, `h2d_act`) share its
bandwidth: each takes the first stretch the link is free for its length, at or after it is
ready and its stream is free (the copy engine interleaves streams; the link carries one byte at
a time).

From this the clock answers the compute stream's busy share of a window, its largest idle gaps,
and the head-of-line blocking of a stream: time an op that was ready sat behind an earlier op
on its FIFO that was itself waiting for a dependency (not transferring).

Nothing here knows the engine; `TimedStreams` and the disk watcher feed it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tierzero.models import ModelArgs


@dataclass(frozen=True)
class Rates:
    """An H200 box: bf16 matmuls at 60% of the 989 TFLOPS peak, PCIe 5 x16 copies at 50 GB/s each
    way, HBM at 4.8 TB/s, one NVMe drive at 7 GB/s read and 5 GB/s write."""

    flops_per_s: float = 0.6 * 989e12
    h2d_bytes_per_s: float = 50e9
    d2h_bytes_per_s: float = 50e9
    hbm_bytes_per_s: float = 4.8e12
    disk_read_bytes_per_s: float = 7e9
    disk_write_bytes_per_s: float = 5e9


@dataclass(frozen=True)
class Scale:
    """Multipliers from the run the fake sees to the run it stands for: kernel FLOPs, the bytes of
    parameter and optimizer-state copies and disk I/O, and the bytes of activation copies (which
    grow with tokens x width, not with the parameter count). All 1: the run as it is."""

    flops: float = 1.0
    state_bytes: float = 1.0
    activation_bytes: float = 1.0

    @classmethod
    def standing_for(
        cls, big: ModelArgs, big_tokens: int, small: ModelArgs, small_tokens: int
    ) -> Scale:
        """A run of `small` on `small_tokens` per micro-batch standing for `big` on `big_tokens`:
        kernels scale with parameters x tokens, state with parameters, and the activations a
        unit hands on with tokens x width (same dtypes: the small run computes in bf16 too)."""
        n_big, n_small = big.param_count(), small.param_count()
        return cls(
            flops=n_big * big_tokens / (n_small * small_tokens),
            state_bytes=n_big / n_small,
            activation_bytes=big_tokens * big.dim / (small_tokens * small.dim),
        )


@dataclass
class Op:
    resource: str  # a stream's name, or "disk"
    kind: str  # copy, kernel, read, write, wait
    thread: str
    ready: float
    start: float
    end: float
    blocked_s: float = 0.0  # head-of-line: ready, but behind an op that waited for a dependency
    what: str = ""
    queue_free: float = 0.0  # when its FIFO had finished the ops before it


LINKS = {
    "h2d": "pcie_h2d",
    "h2d_write": "pcie_h2d",
    "h2d_act": "pcie_h2d",
    "d2h": "pcie_d2h",
}  # stream -> the link it uses


@dataclass
class SimClock:
    rates: Rates = field(default_factory=Rates)
    ops: list[Op] = field(default_factory=list)
    _free: dict[str, float] = field(default_factory=dict)  # resource -> busy until
    _last: dict[str, Op] = field(default_factory=dict)  # resource -> its latest op
    _host: dict[str, float] = field(default_factory=dict)  # thread -> its time
    # span -> when its bytes are valid
    _written: dict[tuple[int, int], float] = field(default_factory=dict)
    # span -> when its last user ends
    _used: dict[tuple[int, int], float] = field(default_factory=dict)
    # link -> busy stretches, sorted
    _link: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def host(self, thread: str) -> float:
        return self._host.get(thread, 0.0)

    def advance_host(self, thread: str, t: float) -> None:
        self._host[thread] = max(self.host(thread), t)

    def now(self) -> float:
        """The latest time anything is busy until."""
        return max([*self._free.values(), *self._host.values(), 0.0])

    def record(self, stream: str, thread: str) -> float:
        """An event at `stream`'s current position: done when its last op is (or when issued)."""
        return max(self._free.get(stream, 0.0), self.host(thread))

    def wait(self, stream: str, at: float, thread: str) -> None:
        """`stream` runs nothing queued after this before `at` (an idle stretch if it was free)."""
        ready = max(at, self.host(thread))
        if ready > self._free.get(stream, 0.0):
            self._run(stream, "wait", thread, ready, 0.0, "waits for an event")

    def copy(
        self,
        stream: str,
        dst: tuple[int, int],
        src: tuple[int, int],
        nbytes: float,
        after: float,
        thread: str,
        what: str,
    ) -> float:
        rate = {
            "h2d": self.rates.h2d_bytes_per_s,
            "h2d_write": self.rates.h2d_bytes_per_s,
            "h2d_act": self.rates.h2d_bytes_per_s,
            "d2h": self.rates.d2h_bytes_per_s,
        }.get(stream, self.rates.hbm_bytes_per_s)
        ready = max(
            self.host(thread),
            after,
            self._latest(self._written, src),
            self._latest(self._used, dst),
        )
        op = self._run(stream, "copy", thread, ready, nbytes / rate, what)
        self._mark(dst, op.end, written=True)
        self._mark(src, op.end, written=False)
        return op.end

    def kernel(self, stream: str, flops: float, thread: str, what: str) -> float:
        return self._run(
            stream, "kernel", thread, self.host(thread), flops / self.rates.flops_per_s, what
        ).end

    def disk(self, kind: str, span: tuple[int, int], nbytes: float, thread: str) -> float:
        """A read into `span` (or a write from it) on the drive's one queue."""
        if kind == "read":
            ready, rate = self._latest(self._used, span), self.rates.disk_read_bytes_per_s
        else:
            ready, rate = self._latest(self._written, span), self.rates.disk_write_bytes_per_s
        op = self._run("disk", kind, thread, ready, nbytes / rate, f"{kind} {nbytes:.0f} B")
        self._mark(span, op.end, written=kind == "read")
        return op.end

    def _run(
        self, resource: str, kind: str, thread: str, ready: float, seconds: float, what: str
    ) -> Op:
        free = self._free.get(resource, 0.0)
        start = max(ready, free)
        if resource in LINKS and seconds > 0:
            start = self._book(LINKS[resource], start, seconds)
        blocked = 0.0
        last = self._last.get(resource)
        if last is not None and last.kind != "wait" and last.ready > max(ready, last.queue_free):
            # the FIFO sat idle waiting for `last`'s dependency while this op could have run
            blocked = min(last.ready, start) - max(ready, last.queue_free)
        op = Op(resource, kind, thread, ready, start, start + seconds, blocked, what, free)
        self.ops.append(op)
        self._free[resource] = op.end
        self._last[resource] = op
        return op

    def _book(self, link: str, earliest: float, seconds: float) -> float:
        """The start of the first stretch of `seconds` the link is free from `earliest`; booked."""
        busy = self._link.setdefault(link, [])
        start = earliest
        for lo, hi in busy:
            if hi <= start:
                continue
            if lo >= start + seconds:
                break
            start = hi
        busy.append((start, start + seconds))
        busy.sort()
        return start

    def link_busy_s(self, link: str, since: int = 0) -> float:
        """Seconds the link carried the copies issued from op number `since` on."""
        return sum(
            op.end - op.start
            for op in self.ops[since:]
            if LINKS.get(op.resource) == link and op.kind == "copy"
        )

    def _latest(self, times: dict[tuple[int, int], float], span: tuple[int, int]) -> float:
        return max([t for s, t in times.items() if s[0] < span[1] and span[0] < s[1]], default=0.0)

    def _mark(self, span: tuple[int, int], t: float, written: bool) -> None:
        """`span`'s bytes are valid from `t` (`written`), and in use until `t` either way."""
        for times in (self._written, self._used) if written else (self._used,):
            for s in [s for s in times if span[0] <= s[0] and s[1] <= span[1] and s != span]:
                del times[s]  # covered by `span`: its time says it all
            times[span] = t if written or times is self._written else max(times.get(span, 0.0), t)

    # -- what the tests read ----------------------------------------------------------------

    def busy_share(
        self, stream: str = "compute", since: float = 0.0, until: float | None = None
    ) -> float:
        """The share of [since, until] in which `stream` runs a kernel or a copy."""
        until = self.now() if until is None else until
        busy = sum(
            max(0.0, min(op.end, until) - max(op.start, since))
            for op in self.ops
            if op.resource == stream and op.kind != "wait"
        )
        return busy / (until - since) if until > since else 0.0

    def busy_s(self, resource: str, since: int = 0) -> float:
        """Seconds `resource` spent on the ops issued from op number `since` on."""
        return sum(
            op.end - op.start
            for op in self.ops[since:]
            if op.resource == resource and op.kind != "wait"
        )

    def snapshot(self) -> SimClock:
        """The clock as it stands: what the tests read once the steps they measure are issued
        (closing the engine issues more)."""
        return dataclasses.replace(
            self,
            ops=list(self.ops),
            _free=dict(self._free),
            _host=dict(self._host),
            _link={k: list(v) for k, v in self._link.items()},
        )

    def mark(self) -> tuple[int, float]:
        """Where a window of work starts: the ops issued so far, and the time everything ends."""
        return len(self.ops), self.now()

    def share(self, since: tuple[int, float], resource: str = "compute") -> float:
        """The share of the time from `since` (a `mark`) to the end of all work issued since that
        `resource` was busy with that work: over whole steps, the GPU-busy share of a step."""
        span = self.now() - since[1]
        return self.busy_s(resource, since[0]) / span if span > 0 else 0.0

    def idle_gaps(
        self, stream: str = "compute", since: float = 0.0, n: int = 5
    ) -> list[tuple[float, Op]]:
        """The `n` longest stretches `stream` sat idle after `since`, each with the op that ended
        it."""
        gaps, end = [], since
        for op in sorted(
            (o for o in self.ops if o.resource == stream and o.kind != "wait"),
            key=lambda o: o.start,
        ):
            if op.start > end:
                gaps.append((op.start - end, op))
            end = max(end, op.end)
        return sorted(gaps, key=lambda g: -g[0])[:n]

    def head_of_line(self, stream: str) -> list[Op]:
        """The ops on `stream` that waited behind an earlier op's dependency."""
        return [op for op in self.ops if op.resource == stream and op.blocked_s > 0]
