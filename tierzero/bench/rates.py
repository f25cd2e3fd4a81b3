"""The GPU benchmark's peaks, measured in the run on the machine as it is: bf16 matmul, the
host<->device copies (on the CPU device: a host memcpy), the work dir's store read and write,
and CPU AdamW (`Rates`, which the plan's bounds divide by). Nothing here prints."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tierzero.bench.plan import Rates


def measure_rates(device: torch.device, disk_dir: Path, direct_io: bool, quick: bool) -> Rates:
    """The peaks in this run: bf16 matmul, pinned H2D/D2H (on the CPU device: a host memcpy),
    the work dir's store read/write (not measured without direct I/O) and CPU AdamW."""
    from tierzero.planning import speeds
    from tierzero.planning.diskbench import DiskBench
    from tierzero.storage.host import HostPool
    from tierzero.storage.io import IOLoop

    cpu = device.type == "cpu"
    seconds = 0.1 if cpu else 0.5 if quick else 1.0
    if cpu:
        tflops = speeds.matmul_tflops(torch.bfloat16, n=256, seconds=seconds)
        h2d = d2h = _memcpy_gbps(16 << 20, seconds)
    else:
        with torch.cuda.device(device):
            tflops = speeds.matmul_tflops(
                torch.bfloat16, n=8192, seconds=2 * seconds, device=device
            )
            h2d = speeds.h2d_gbps(1 << 30, seconds=seconds)
            d2h = speeds.h2d_gbps(1 << 30, seconds=seconds, to_host=True)
    read = write = 0.0
    if direct_io:
        nbytes = 16 << 20 if cpu else 1 << 30 if quick else 4 << 30
        with (
            IOLoop(16) as io_loop,
            HostPool(nbytes, pin=False) as pool,
            DiskBench(str(disk_dir), nbytes, io_loop, pool, rounds=1) as disk,
        ):
            for step in disk.steps():
                if step.group == 0:
                    step.run()
            nvme = disk.result()["nvme"]
        read, write = nvme["read_gbps"], nvme["write_gbps"]
    adam = speeds.adam_params_per_s(1 << 20 if cpu else 1 << 24, seconds)
    return Rates(tflops, h2d, d2h, read, write, adam)


def _memcpy_gbps(nbytes: int, seconds: float) -> float:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9
