"""What one profiled step says about the GPU's time: pure logic over a `torch.profiler` Chrome
trace.

The trace's complete events (`"ph": "X"`, microseconds) are of two kinds. GPU activity --
kernels, memcpys, memsets, one timeline per stream -- and host calls: operators (`cpu_op`),
CUDA runtime and driver calls, annotations, one timeline per thread. A runtime call that
launches GPU work shares its `correlation` id with that work. From these:

- the GPU busy share: the union of all GPU activity over the step's window (first to last event
  of any kind), and the compute share (kernels alone);
- the copy overlap: the share of memcpy time during which a kernel also runs (copies hidden
  behind compute: 1.0 is the copy pipeline's aim);
- the largest GPU-idle gaps, each with the host call that caused it. A gap ends when the next
  GPU work starts; that work's launch (the runtime call with its correlation id) is found on
  its thread. If it was launched only after the gap opened, the GPU waited for the host: the
  cause is the host call on that thread that covers most of the gap (a sync, a future's
  result, a blocking copy) other than the operator that made the launch, else that operator.
  If it was launched before, the GPU waited for an event on another stream.

`write_trace` keeps the trace file under a size by dropping the shortest host events first
(GPU activity and runtime calls are kept: the analysis needs them).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
HOST_CATEGORIES = frozenset({"cpu_op", "python_function", "user_annotation", *RUNTIME_CATEGORIES})
TRACE_LIMIT_BYTES = 10_000_000


@dataclass(frozen=True)
class Span:
    """One complete event: [start, end) in microseconds, on one GPU stream or host thread."""

    start: float
    end: float
    name: str
    category: str
    lane: tuple[Any, Any]  # (pid, tid): a device's stream, or a process's thread
    correlation: int | None

    @property
    def dur(self) -> float:
        return self.end - self.start


def spans(trace: dict[str, Any] | list[dict[str, Any]]) -> list[Span]:
    """The complete events of a Chrome trace (its dict, or its event list), ordered by start."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    out = [
        Span(
            float(e["ts"]),
            float(e["ts"]) + float(e.get("dur", 0.0)),
            str(e.get("name", "")),
            str(e.get("cat", "")),
            (e.get("pid"), e.get("tid")),
            (e.get("args") or {}).get("correlation"),
        )
        for e in events
        if e.get("ph") == "X" and "ts" in e
    ]
    return sorted(out, key=lambda s: (s.start, -s.end))


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals as disjoint, ordered intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def measure(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merged(intervals))


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The length of the intersection of two unions of intervals."""
    a, b = merged(a), merged(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class Gap:
    """A stretch with no GPU activity, the work that ended it and what the host was doing."""

    start_us: float
    dur_us: float
    next_gpu: str  # the GPU work that ended the gap ("" at the window's end)
    launched_by: str  # the operator (else the runtime call) that launched it
    cause: str  # the host call that held the GPU idle, or "an event on another stream (...)"

    def as_dict(self) -> dict[str, Any]:
        return {
            "start_us": self.start_us,
            "dur_us": self.dur_us,
            "next_gpu": self.next_gpu,
            "launched_by": self.launched_by,
            "cause": self.cause,
        }


def analyse(trace: dict[str, Any] | list[dict[str, Any]], largest: int = 5) -> dict[str, Any]:
    """The step's GPU busy share, compute share, copy overlap and its `largest` idle gaps
    (None and [] where the trace holds no GPU activity, as a CPU-only profile)."""
    every = spans(trace)
    if not every:
        return {
            "window_us": 0.0,
            "gpu_events": 0,
            "gpu_busy_share": None,
            "compute_busy_share": None,
            "copy_overlap": None,
            "gaps": [],
        }
    window = (min(s.start for s in every), max(s.end for s in every))
    length = window[1] - window[0]
    gpu = [s for s in every if s.category in GPU_CATEGORIES]
    out: dict[str, Any] = {
        "window_us": length,
        "gpu_events": len(gpu),
        "gpu_busy_share": None,
        "compute_busy_share": None,
        "copy_overlap": None,
        "gaps": [],
    }
    if not gpu or length <= 0:
        return out
    busy = merged([(s.start, s.end) for s in gpu])
    kernels = [(s.start, s.end) for s in gpu if s.category == "kernel"]
    copies = [(s.start, s.end) for s in gpu if s.category == "gpu_memcpy"]
    out["gpu_busy_share"] = measure(busy) / length
    out["compute_busy_share"] = measure(kernels) / length
    out["copy_overlap"] = (
        overlap(copies, kernels) / measure(copies) if measure(copies) > 0 else None
    )
    edges = [window[0], *(x for interval in busy for x in interval), window[1]]
    idle = [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2) if edges[i + 1] > edges[i]]
    idle.sort(key=lambda g: g[1] - g[0], reverse=True)
    out["gaps"] = [_explain(a, b, every, gpu).as_dict() for a, b in idle[:largest]]
    return out


def _explain(a: float, b: float, every: list[Span], gpu: list[Span]) -> Gap:
    """The gap [a, b): the GPU work that ended it, who launched it, and why it waited."""
    following = [s for s in gpu if s.start >= b]
    if not following:
        return Gap(
            a,
            b - a,
            "",
            "",
            _longest_host(a, b, every, None) or "the host, after the last GPU work",
        )
    work = following[0]
    launch = next(
        (
            s
            for s in every
            if s.category in RUNTIME_CATEGORIES
            and s.correlation is not None
            and s.correlation == work.correlation
        ),
        None,
    )
    if launch is None:
        return Gap(
            a,
            b - a,
            work.name,
            "",
            _longest_host(a, b, every, None) or "unknown (no launch in the trace)",
        )
    enclosing = [
        s
        for s in every
        if s.lane == launch.lane
        and s.category in HOST_CATEGORIES
        and s.start <= launch.start
        and s.end >= launch.end
        and s is not launch
    ]
    operator = min(enclosing, key=lambda s: s.dur).name if enclosing else launch.name
    if launch.end <= a:
        return Gap(
            a,
            b - a,
            work.name,
            operator,
            f"an event on another stream ({work.name} was launched by {operator} before the gap)",
        )
    cause = _longest_host(a, b, every, launch)
    return Gap(a, b - a, work.name, operator, cause or operator)


def _longest_host(a: float, b: float, every: list[Span], launch: Span | None) -> str | None:
    """The host call (on the launch's thread, if given) that covers most of [a, b), skipping the
    launch and the calls enclosing it (they made the launch, they did not delay it)."""
    best, covered = None, 0.0
    for s in every:
        if s.category not in HOST_CATEGORIES or s.end <= a or s.start >= b:
            continue
        if launch is not None and (
            s.lane != launch.lane or (s.start <= launch.start and s.end >= launch.end)
        ):
            continue
        part = min(s.end, b) - max(s.start, a)
        if part > covered:
            best, covered = s.name, part
    return best


def write_trace(
    trace: dict[str, Any], path: Path, limit_bytes: int = TRACE_LIMIT_BYTES
) -> dict[str, Any]:
    """Write `trace` gzipped to `path`, under `limit_bytes`: host events shorter than a rising
    threshold are dropped until it fits. Returns its size and the threshold used (0: none)."""
    events = trace.get("traceEvents", [])
    for threshold in (0.0, 10.0, 100.0, 1_000.0, 10_000.0, float("inf")):
        kept = [e for e in events if threshold == 0 or not _droppable(e, threshold)]
        data = gzip.compress(json.dumps({**trace, "traceEvents": kept}).encode(), compresslevel=6)
        if len(data) < limit_bytes or threshold == float("inf"):
            break
    if len(data) >= limit_bytes:  # the GPU timeline alone is too big: keep its first events
        kept = kept[: max(1, len(kept) * limit_bytes // (2 * len(data)))]
        data = gzip.compress(json.dumps({**trace, "traceEvents": kept}).encode(), compresslevel=6)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return {
        "path": str(path),
        "nbytes": len(data),
        "events": len(kept),
        "dropped_host_below_us": threshold,
    }


def _droppable(event: dict[str, Any], threshold_us: float) -> bool:
    """Host events below the threshold, and flow arrows, go first; GPU work and runtime calls
    stay."""
    if event.get("ph") != "X":
        return event.get("ph") in ("s", "f", "t")
    category = event.get("cat", "")
    if category in GPU_CATEGORIES or category in RUNTIME_CATEGORIES:
        return False
    return float(event.get("dur", 0.0)) < threshold_us


def load_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace written by `torch.profiler` (plain or gzipped JSON)."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    trace = json.loads(raw)
    return trace if isinstance(trace, dict) else {"traceEvents": trace}
