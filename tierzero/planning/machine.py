"""The one machine probe: free host memory, free disk space, the default budgets and dtype.

`tierzero plan` and `tierzero train` ask the same functions, so they agree on the budgets (and
hence on placement and precision) for the same machine. Nothing else in the package reads /proc/meminfo,
asks CUDA how much memory is free or measures a disk.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from tierzero.config import DType


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budgets(device: torch.device, local_ranks: int = 1) -> tuple[int, int]:
    """(host, gpu) budgets when none is configured: half the free RAM, shared evenly by the
    `local_ranks` ranks on this machine; 90% of this rank's GPU's free memory (on the CPU
    device, a quarter of the free RAM, shared likewise)."""
    host = available_host_bytes() // 2 // local_ranks
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return host, int(free * 0.9)
    return host, available_host_bytes() // 4 // local_ranks


def default_dtype(device: torch.device | str) -> DType:
    """bf16 on GPUs that compute in it natively, else fp32 (CPU bf16 is slow, fp16 needs a
    scaler; emulated bf16 before Ampere computes at fp32 cost with bf16 rounding)."""
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            if torch.cuda.is_bf16_supported(including_emulation=False):
                return DType.BF16
    return DType.FP32


def free_disk_bytes(paths: Sequence[str | Path]) -> int:
    """Free bytes on the fullest of `paths` (shards stripe evenly across them); a path not yet
    created counts as its nearest existing parent."""
    return min(shutil.disk_usage(_existing(Path(p))).free for p in paths)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
