"""fio, the reference `DiskBench` compares the store with: its sweep, command lines and figures.

A sweep (`fio_sweep`) picks the best configuration for each direction; it covers the store's
own shape -- 16 submitters with one request each (psync, io_uring) -- as well as libaio and
io_uring at depth, since a review found that fio never had the store's concurrency to pick
from. io_uring is swept only where fio has it and a tiny probe run works (`fio_engines`).

fio's own group bandwidth divides the bytes by the longest *single* job's runtime, but its jobs
start staggered: on short writes here it overstated the aggregate by up to 1.5x. So fio's
figure is ours too (`fio_wall_span`): all bytes over the wall span from the first request's
submission to the last completion, read off its per-request latency logs (`--write_lat_log`,
Unix-epoch times in ms, so +-2 ms: about 1% of a 1 GiB run) -- the same definition the store is
timed by. Data is incompressible and never repeated (`--refill_buffers`, `--randrepeat=0`; see
`diskbench` for why not fio's scrambling). This module runs fio and reads its output; `DiskBench`
decides when.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

from tierzero.storage.base import StorageError

FioConfig = tuple[str, int, int, int]  # engine, block bytes, queue depth, jobs
STORE_SHAPE_JOBS = 16  # the CLI's I/O threads: 16 submitters, one request each


def fio_sweep(engines: frozenset[str] | set[str]) -> list[FioConfig]:
    """fio's configurations to try, for the `engines` this fio can run (psync and libaio always).

    libaio at depth with few jobs (fio's usual best), the store's own shape (16 jobs, one request
    each: psync is exactly 16 threads calling pwrite), and io_uring at both where available."""
    depth = [
        (bs, iodepth, numjobs)
        for bs in (1 << 20, 8 << 20)
        for iodepth in (8, 32)
        for numjobs in (1, 4)
    ]
    shape = [(bs, 1, STORE_SHAPE_JOBS) for bs in (1 << 20, 8 << 20)]
    sweep = [("libaio", *c) for c in depth] + [("psync", *c) for c in shape]
    if "io_uring" in engines:
        sweep += [("io_uring", *c) for c in depth + shape]
    return sweep


def fio_command(
    rw: str, config: FioConfig, filename: str, nbytes: int, direct: bool, log_prefix: str
) -> list[str]:
    """The fio command line for one run: `numjobs` jobs splitting `nbytes` of one file into
    disjoint regions (so every configuration reads and writes the same slot file), with
    incompressible, never-repeated data (see the module docstring)."""
    engine, bs, iodepth, numjobs = config
    per_job = nbytes // numjobs // bs * bs
    cmd = [
        "fio",
        "--name=tierzero",
        f"--filename={filename}",
        f"--rw={rw}",
        f"--bs={bs}",
        f"--ioengine={engine}",
        f"--iodepth={iodepth}",
        f"--numjobs={numjobs}",
        f"--size={per_job}",
        f"--offset_increment={per_job}",
        f"--direct={int(direct)}",
        "--refill_buffers=1",
        "--randrepeat=0",
        "--invalidate=1",
        "--group_reporting",
        "--output-format=json",
        f"--write_lat_log={log_prefix}",
        "--log_unix_epoch=1",
    ]
    if rw == "write" and not direct:
        cmd.append("--end_fsync=1")  # in fio's own figure; its latency logs leave it out
    return cmd


def fio_wall_span(log_dir: str) -> tuple[float, int]:
    """A fio run's wall span in seconds and its bytes, from its per-request total-latency logs.

    Each line is `completion time (ms since the epoch), latency (ns), direction, bytes, ...`
    (fio 3.x; 2.x logged microseconds); a request was submitted `latency` before it completed."""
    start, end, nbytes = float("inf"), 0.0, 0
    for name in os.listdir(log_dir):
        if not name.startswith("job_lat."):  # job_lat.N.log; skip the slat and clat logs
            continue
        path = os.path.join(log_dir, name)
        with open(path) as f:
            for line in f:
                try:
                    done_ms, lat_ns, _, size = (int(x) for x in line.split(",")[:4])
                except ValueError:
                    raise StorageError(
                        f"cannot read fio's latency log line {line.strip()!r} in "
                        f"{path}: use fio 3.x or run without --fio"
                    ) from None
                start = min(start, done_ms - lat_ns / 1e6)
                end = max(end, done_ms)
                nbytes += size
    if not nbytes:
        raise StorageError(
            f"fio wrote no latency log in {log_dir}: it needs --write_lat_log and "
            f"--log_unix_epoch (fio 3.x); upgrade fio or run without --fio"
        )
    return max(end - start, 1.0) / 1e3, nbytes  # ms timestamps: never below one tick


def check_fio() -> None:
    """fio must be on PATH and 3.x or newer (2.x logged latencies in microseconds)."""
    if shutil.which("fio") is None:
        raise StorageError(
            "--fio needs fio on PATH: install it (Debian/Ubuntu: apt-get install fio) or drop --fio"
        )
    version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    major = version.removeprefix("fio-").split(".")[0]
    if not major.isdigit() or int(major) < 3:
        raise StorageError(
            f"--fio needs fio 3.0 or newer, found {version or 'an unknown fio'}: "
            f"upgrade fio or drop --fio"
        )


def fio_engines(work: str, direct: bool) -> tuple[frozenset[str], dict[str, str]]:
    """The optional engines this fio can run here, and why each other one is skipped.

    io_uring may be built into fio yet refused by the kernel or a container's seccomp filter,
    so a listed engine must also finish a one-block run."""
    listed = subprocess.run(["fio", "--enghelp"], capture_output=True, text=True).stdout.split()
    if "io_uring" not in listed:
        return frozenset(), {"io_uring": "not built into this fio (fio --enghelp)"}
    probe = os.path.join(work, "fio-probe.bin")
    cmd = [
        "fio",
        "--name=probe",
        f"--filename={probe}",
        "--rw=write",
        "--bs=4k",
        "--size=4k",
        "--ioengine=io_uring",
        f"--direct={int(direct)}",
        "--output-format=json",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    if done.returncode != 0:
        return frozenset(), {"io_uring": f"a probe run failed: {done.stderr.strip()[-200:]}"}
    return frozenset({"io_uring"}), {}


def run_fio(cmd: list[str], path: str) -> dict[str, Any]:
    """Run fio and return its JSON report; a failure is a domain error naming the file."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise StorageError(
            f"fio failed on {path}: {done.stderr.strip()[-300:]}; run without "
            f"--fio or check the fio installation"
        )
    report: dict[str, Any] = json.loads(done.stdout[done.stdout.index("{") :])
    return report


def config_name(engine: str, bs: int, iodepth: int, numjobs: int) -> str:
    return f"{engine} bs={bs >> 20}M iodepth={iodepth} numjobs={numjobs}"
