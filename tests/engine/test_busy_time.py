"""Busy time per link: the union of the intervals in which an operation on the link ran.

The union is checked as data (overlapping, nested, disjoint, touching); the log with a fake
clock (no timing thresholds), its CUDA-event path with fake events offset in milliseconds as
CUDA reports them, and the CPU streams' copies landing on the link of their direction. A
tiered run's metrics hold busy time for the links it used and zero for those it did not; an
in-memory run (the plain trainer) logs none."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from tierzero.cli.app import app
from typer.testing import CliRunner

from tierzero.engine.runtime.busy import OPTIMIZER, BusyLog, union_s
from tierzero.engine.runtime.streams import CpuStreams
from tierzero.engine.runtime.transfers import BUSY_LINKS, TransferStats
from tierzero.run.directory import read_metrics


@pytest.mark.parametrize(
    ("intervals", "union"),
    [
        ([], 0.0),
        ([(0.0, 1.0)], 1.0),
        ([(0.0, 1.0), (0.5, 2.0)], 2.0),  # overlapping
        ([(0.0, 4.0), (1.0, 2.0), (2.5, 3.0)], 4.0),  # nested
        ([(0.0, 1.0), (2.0, 3.5)], 2.5),  # disjoint
        ([(2.0, 3.0), (0.0, 1.0), (1.0, 2.0)], 3.0),  # touching, out of order
        ([(0.0, 1.0)] * 16, 1.0),  # sixteen threads at once: one second busy, not sixteen
        ([(0.0, 3.0), (1.0, 2.0), (2.5, 5.0), (6.0, 7.0)], 6.0),
    ],
)
def test_union_counts_each_instant_once(intervals, union) -> None:
    assert union_s(intervals) == pytest.approx(union)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_log_takes_each_links_union_per_window() -> None:
    clock = FakeClock()
    log = BusyLog(clock)
    clock.now = 10.0
    with log.timed("nvme->host"):
        clock.now = 12.0
    log.add("nvme->host", 11.0, 13.0)  # a second thread, overlapping the first read
    log.add("host->nvme", 9.0, 10.5)  # began before the window: counted from its start (0.0)
    clock.now = 20.0
    assert log.take() == {"nvme->host": 3.0, "host->nvme": 1.5}
    log.add("optimizer", 19.0, 21.0)  # straddles the last take: only its part after it counts
    clock.now = 22.0
    assert log.take() == {"optimizer": 1.0}
    assert log.take() == {}


def test_intervals_from_many_threads_all_land() -> None:
    log = BusyLog(FakeClock())
    threads = [
        threading.Thread(
            target=lambda i=i: [log.add("x", i + j / 100, i + j / 100 + 0.5) for j in range(50)]
        )
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.clock.now = 100.0
    assert log.take()["x"] == pytest.approx(8 * 0.99)  # each thread: 0.00 .. 0.99 past i


class FakeCudaEvent:
    """A timing event recorded `at_ms` on the device's clock; `elapsed_time` as CUDA answers it."""

    def __init__(self, at_ms: float, done: bool = True) -> None:
        self.at_ms = at_ms
        self.done = done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        return end.at_ms - self.at_ms


def test_device_intervals_come_from_event_pairs_on_one_time_base() -> None:
    log = BusyLog(FakeClock())
    # ms; the second overlaps the first
    pairs = [(500.0, 1500.0), (1000.0, 2000.0), (3000.0, 3250.0)]
    events = [(FakeCudaEvent(a), FakeCudaEvent(b)) for a, b in pairs]
    for start, end in events:
        log.add_events("host->gpu", start, end)
    # before the first: negative offsets
    log.add_events("gpu->host", FakeCudaEvent(100.0), FakeCudaEvent(600.0))
    running = FakeCudaEvent(4000.0, done=False)  # a prefetch still copying: read next time
    log.add_events("host->gpu", FakeCudaEvent(3500.0), running)
    assert log.take() == pytest.approx({"host->gpu": 1.75, "gpu->host": 0.5})
    running.done = True
    assert log.take() == pytest.approx({"host->gpu": 0.5})


@pytest.mark.parametrize(
    ("stream", "link"), [("d2h", "gpu->host"), ("h2d", "host->gpu"), ("compute", None)]
)
def test_cpu_copies_are_timed_on_the_link_of_their_direction(stream: str, link: str | None) -> None:
    streams = CpuStreams()
    stats = TransferStats()
    streams.busy = stats.busy
    dst, src = torch.zeros(1 << 16), torch.ones(1 << 16)
    streams.copy(dst, src, getattr(streams, stream))
    assert torch.equal(dst, src)
    busy = {k[len("busy_s/") :]: v for k, v in stats.take().items() if k.startswith("busy_s/")}
    assert set(busy) == set(BUSY_LINKS)
    assert {k for k, v in busy.items() if v > 0} == ({link} if link else set())


def test_nvme_reads_and_writes_land_on_their_links() -> None:
    stats, clock = TransferStats(), FakeClock()
    stats.busy = BusyLog(clock)
    stats.nvme_busy("read", 1.0, 2.0)
    stats.nvme_busy("write", 1.5, 2.0)
    clock.now = 3.0
    taken = stats.busy.take()
    assert taken == {"nvme->host": 1.0, "host->nvme": 0.5}


@pytest.mark.parametrize("offload", ["none", "nvme", "host"])
def test_a_runs_metrics_hold_busy_time_for_the_links_it_used(tmp_path, offload: str) -> None:
    run_dir = tmp_path / "run"
    args = [
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--eval-every",
        "0",
        "--offload",
        offload,
    ]
    result = CliRunner().invoke(app, ["train", *args, "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    if offload == "none":  # no tiers: the plain trainer logs no links at all
        assert not any(k.startswith(("busy_s/", "bytes_")) for r in steps for k in r)
        return
    assert all(f"busy_s/{link}" in r for r in steps for link in BUSY_LINKS)
    nvme = ("nvme->host", "host->nvme")
    for r in steps:
        assert r[f"busy_s/{OPTIMIZER}"] > 0
        assert all((r[f"busy_s/{link}"] > 0) == (offload == "nvme") for link in nvme), r
        for link in BUSY_LINKS:  # no link is busy for longer than the time since the last step
            assert r[f"busy_s/{link}"] <= r["wall_s"]
    json.dumps(steps)  # every figure is plain JSON
