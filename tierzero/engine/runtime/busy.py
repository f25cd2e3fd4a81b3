"""Busy time per link: the stretches in which at least one operation on a link was running.

Each operation on a link (an NVMe chunk read or write on an I/O thread, a host<->device copy on
its stream, one optimizer step of a piece) adds its interval; once per step `take()` merges
each link's intervals and returns their union's length. A union, not a sum: sixteen threads
reading at once for one second keep `nvme->host` busy for one second. Set beside the step's
wall time, these say whether the step approaches the slowest link's time (overlapped) or the
sum of them (serialised).

Host work is timed with a `perf_counter` pair (the `clock`). Work on a GPU stream is timed with
a pair of CUDA timing events, read at `take()` (after the step, when they have happened) as
offsets from the window's first such event: a link's intervals share one time base, so their
union is exact, whichever clock each link uses. Nothing here waits, during the step or at
`take()` (a pair still running is read at the next one).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

OPTIMIZER = "optimizer"  # the optimizer's compute, stepping pieces (not its waits)


def union_s(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of `(start, end)` intervals: overlaps and nestings count once."""
    total = 0.0
    end = -float("inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue  # nested in what is already counted
        total += b - max(a, end)
        end = b
    return total


class BusyLog:
    """Intervals per link, added from any thread; `take()` turns a step's into busy seconds."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self._events: list[tuple[str, Any, Any]] = []  # (link, start, end) CUDA timing events
        self._lock = threading.Lock()
        self._since = clock()  # the window's start: an interval begun earlier counts from here

    def add(self, link: str, start: float, end: float) -> None:
        """One operation on `link` ran from `start` to `end` (`clock` seconds)."""
        with self._lock:
            self._intervals[link].append((start, end))

    @contextmanager
    def timed(self, link: str) -> Iterator[None]:
        """Time the block as one operation on `link` (host work: it runs while the block does)."""
        start = self.clock()
        try:
            yield
        finally:
            self.add(link, start, self.clock())

    def add_events(self, link: str, start: Any, end: Any) -> None:
        """One operation on `link` ran on a GPU stream between two recorded timing events."""
        with self._lock:
            self._events.append((link, start, end))

    def take(self) -> dict[str, float]:
        """Each link's busy seconds since the last call (host intervals clipped to that window)."""
        now = self.clock()
        with self._lock:
            intervals, self._intervals = self._intervals, defaultdict(list)
            # an event pair still running (a prefetch for the next step) waits for the next
            # window: querying never blocks, so taking the counters is no host sync point
            events: list[tuple[str, Any, Any]] = []
            running: list[tuple[str, Any, Any]] = []
            for pair in self._events:
                (events if pair[2].query() else running).append(pair)
            self._events = running
        since, self._since = self._since, now
        out = {
            link: union_s(
                (max(a, since), min(b, now)) for a, b in spans if min(b, now) > max(a, since)
            )
            for link, spans in intervals.items()
        }
        for link, busy in _event_busy(events).items():
            out[link] = out.get(link, 0.0) + busy
        return out


def _event_busy(events: list[tuple[str, Any, Any]]) -> dict[str, float]:
    """Busy seconds per link of finished CUDA event pairs, as offsets from the first start
    event (`elapsed_time` is signed: an earlier event is a negative offset)."""
    if not events:
        return {}
    origin = events[0][1]
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for link, start, end in events:
        spans[link].append((origin.elapsed_time(start) / 1e3, origin.elapsed_time(end) / 1e3))
    return {link: union_s(s) for link, s in spans.items()}
