"""The invariants of the copy pipeline, read from the recording fake's log: each `check_*` returns
the problems it finds (an empty list when the invariant holds), so a test asserts `== []` and a
failure names every offending copy or wait."""

from __future__ import annotations

from tests.support.fakes.clock import SimClock


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
                problems.append(
                    f"h2d copy into 0x{entry[2]:x} waits for {entry[3]}, not its release {ready}"
                )
        elif entry[0] == "wait" and entry[1] == "h2d":
            problems.append(f"the h2d stream waits for {entry[2]} outside a copy")
    return problems


def check_no_host_wait_on_compute(log: list[tuple]) -> list[str]:
    """The host never waits for the compute stream (that is a device synchronisation)."""
    return [
        f"host waits for compute event {e[1]} on thread {e[2]}"
        for e in log
        if e[0] == "host_wait" and e[1] is not None and e[1].stream == "compute"
    ]


def check_collectives_waited_for(log: list[tuple]) -> list[str]:
    """Every collective's output was waited for (by a stream or the host) before the run ended:
    one never waited for was read unordered with it, or not at all."""
    waited = {e[2].known.get("comm", 0) for e in log if e[0] == "wait" and e[2] is not None}
    waited |= {e[1].known.get("comm", 0) for e in log if e[0] == "host_wait" and e[1] is not None}
    latest = max(waited, default=0)
    return [
        f"comm collective {e[3].seq} (issued on {e[1]}) was never waited for"
        for e in log
        if e[0] == "collective" and e[3].seq > latest
    ]


def check_no_copy_hazards(log: list[tuple]) -> list[str]:
    """No copy touches bytes another stream's copy writes (or reads) without waiting for it."""
    return [e[1] for e in log if e[0] == "hazard"]


def check_d2h_copies_wait_for_their_source(log: list[tuple]) -> list[str]:
    """A grad copied to the host waits for the compute event that produced it."""
    return [
        f"d2h copy into 0x{e[2]:x} does not wait for compute"
        for e in log
        if e[0] == "copy" and e[1] == "d2h" and (e[3] is None or e[3].stream != "compute")
    ]


# the host -> device streams (one where writes and inputs share h2d)
_H2D = ("h2d", "h2d_write", "h2d_act")


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
                problems.append(
                    f"h2d copy into 0x{entry[2]:x}: neither a device pool buffer nor "
                    "memory allocated for the h2d stream"
                )
            fresh.discard(entry[2])
    return problems


def check_no_host_wait_on_io_threads(log: list[tuple]) -> list[str]:
    """No I/O worker (nor the loop's thread) sleeps on an event: that is the waiter's job
    (`IOLoop.wait_off_workers`), so NVMe reads and the CPU optimizer never queue behind a wait."""
    return [
        f"{e[2]} waits for {e[1]}"
        for e in log
        if e[0] == "host_wait" and e[1] is not None and e[2].startswith("tierzero-io")
    ]


def check_allocator_memory_kept_alive(
    log: list[tuple], device_spans: set[tuple[int, int]]
) -> list[str]:
    """Memory torch's caching allocator owns, used on a stream other than the one it was
    allocated on, is `keep_alive`d there (`record_stream` on a GPU), or the allocator may hand
    it out again while that stream still reads it: a d2h copy's source outside the device
    pool's blocks (a grad autograd allocated on compute) for the d2h stream, and memory
    allocated for the h2d stream (which compute then reads) for compute."""
    kept = {(e[2], e[1]) for e in log if e[0] == "keep_alive"}
    problems = [
        f"d2h copy from 0x{e[6]:x} (allocator memory) without keep_alive on d2h"
        for e in log
        if e[0] == "copy"
        and e[1] == "d2h"
        and (e[6], "d2h") not in kept
        and not any(a <= e[6] < b for a, b in device_spans)
    ]
    return problems + [
        f"memory allocated for {e[1]} at 0x{e[2]:x} never kept alive for compute"
        for e in log
        if e[0] == "alloc" and e[1] != "compute" and (e[2], "compute") not in kept
    ]


def check_writes_into_read_before_waited(
    log: list[tuple], spans: list[tuple[int, int]]
) -> list[str]:
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
                problems.append(
                    f"a write into 0x{entry[2]:x} on {entry[1]}, not the {writes} stream"
                )
            if entry[3] is None or entry[3].stream != "compute":
                problems.append(
                    f"{entry[1]} write into 0x{entry[2]:x} waits for {entry[3]}, not compute"
                )
            unwaited[(entry[1], entry[5].seq)] = entry[2]
        elif entry[0] == "wait" and entry[1] == "compute" and entry[2] is not None:
            known = entry[2].known
            unwaited = {
                (s, seq): ptr for (s, seq), ptr in unwaited.items() if seq > known.get(s, 0)
            }
    if spans and not any(
        e[0] == "copy" and e[1] in _H2D and any(a <= e[2] < b for a, b in spans) for e in log
    ):
        problems.append(
            "nothing was written into the spans on a host -> device stream (a blocking copy?)"
        )
    return problems + [
        f"compute never waits for the h2d write into 0x{ptr:x}" for ptr in unwaited.values()
    ]


def check_step_near_its_bound(
    clock: SimClock, mark: tuple[int, float], ratio: float = 1.15
) -> list[str]:
    """The work issued since `mark` (whole steps) takes at most `ratio` x its busiest resource
    (compute, either direction of the link, the drive): what overlap promises. The GPU-idle
    share of the steps is then at most 1 - compute / (ratio x bound)."""
    busiest = {
        "compute": clock.busy_s("compute", mark[0]),
        "disk": clock.busy_s("disk", mark[0]),
        "pcie_h2d": clock.link_busy_s("pcie_h2d", mark[0]),
        "pcie_d2h": clock.link_busy_s("pcie_d2h", mark[0]),
    }
    name, bound = max(busiest.items(), key=lambda kv: kv[1])
    span = clock.now() - mark[1]
    if span <= ratio * bound:
        return []
    gaps = "; ".join(
        f"{gap * 1e3:.1f} ms before {op.what} on {op.thread}"
        for gap, op in clock.idle_gaps(since=mark[1], n=3)
    )
    return [
        f"the steps take {span:.3f} s, {span / bound:.2f} x their busiest resource "
        f"({name}, {bound:.3f} s); "
        f"compute busy {clock.share(mark):.0%}; longest GPU-idle gaps: {gaps}"
    ]


def check_no_head_of_line_blocking(clock: SimClock, stream: str = "h2d") -> list[str]:
    """No op on `stream` that was ready sat behind an earlier op on the same FIFO that was waiting
    for its own dependency (a fetch behind a write gated on compute, say)."""
    return [
        f"{op.what} {op.kind} on {stream} (thread {op.thread}) ready at "
        f"{op.ready * 1e3:.2f} ms sat {op.blocked_s * 1e3:.2f} ms behind an op waiting for its "
        "dependency"
        for op in clock.head_of_line(stream)
    ]


def check_no_reuse_in_flight(log: list[tuple]) -> list[str]:
    """No storage torch's allocator owns is freed while a copy on another stream still reads it
    unless it was kept alive there: the caching allocator would hand it out again mid-copy."""
    return [e[3] for e in log if e[0] == "reuse"]
