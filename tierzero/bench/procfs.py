"""This process as Linux counts it, for the benchmarks: the machine's RAM, resident memory and
storage I/O from /proc, and `RssWatch`, the peak resident memory of each phase of a run (and the
drive's used bytes at their peak). Nothing here prints."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RSS_SAMPLE_S = 0.2


def mem_total_bytes() -> int:
    """MemTotal from /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo: this benchmark needs Linux")


def proc_status_bytes(field: str) -> int:
    """A `Vm*` line of /proc/self/status (kB) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def proc_io() -> dict[str, int]:
    """This process's I/O counters: read_bytes / write_bytes reached a block device (O_DIRECT
    too)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


class RssWatch:
    """Peak resident memory per phase, from the OS.

    Two views of the same thing: VmHWM, the kernel's high-water mark, reset to the current RSS at
    each phase's start by writing 5 to /proc/self/clear_refs (Linux >= 4.0); and the largest
    VmRSS a daemon thread sampled every `RSS_SAMPLE_S` while the phase ran (it can miss a spike
    shorter than the interval; VmHWM cannot). If clear_refs is refused, VmHWM is the peak since
    the process started, and the report says so.
    """

    def __init__(self, disk: Path) -> None:
        self.disk = disk
        self.disk_used0 = shutil.disk_usage(disk).used
        self.disk_peak = 0  # the drive's used bytes above disk_used0, at most
        self.at_start: dict[str, int] = {}  # VmRSS as the phase began
        self.hwm: dict[str, int] = {}
        self.sampled: dict[str, int] = {}
        self.hwm_resettable = True
        self._phase: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self.disk_peak = max(
                self.disk_peak, shutil.disk_usage(self.disk).used - self.disk_used0
            )
            phase = self._phase
            if phase is not None:
                rss = proc_status_bytes("VmRSS")
                self.sampled[phase] = max(self.sampled.get(phase, 0), rss)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.hwm_resettable = False
        self.at_start[name] = self.sampled[name] = proc_status_bytes("VmRSS")
        self._phase = name
        try:
            yield
        finally:
            self._phase = None
            self.hwm[name] = proc_status_bytes("VmHWM")
            self.sampled[name] = max(self.sampled[name], proc_status_bytes("VmRSS"))

    def combine(self, name: str, phases: list[str]) -> None:
        """Record `name` as the span of consecutive `phases` (their peaks, the first one's
        start)."""
        self.at_start[name] = self.at_start[phases[0]]
        self.hwm[name] = max(self.hwm[p] for p in phases)
        self.sampled[name] = max(self.sampled[p] for p in phases)
