"""The one machine probe: free host memory, free disk space, the default budgets and dtype.

`tierzero plan` and `tierzero train` ask the same functions, so they agree on the budgets (and
hence on placement and precision) for the same machine. Nothing else in the package reads
/proc/meminfo, asks CUDA how much memory is free or measures a disk. `plan_budgets` and
`train_dtype` are a plan's machine: the sizes given, else these defaults.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from tierzero.config import DType, Tier, parse_bytes
from tierzero.errors import ConfigError


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


def train_dtype(device: str) -> DType:
    """The dtype `tierzero train` computes in by default: fp32 on the CPU, and on a GPU what it
    has (`default_dtype`); bf16 on a GPU sized by --gpu-mem on a machine without one."""
    if device == "cuda" and not torch.cuda.is_available():
        return DType.BF16
    return default_dtype(torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"))


def plan_budgets(
    gpu_mem: str | int | None,
    host_mem: str | int | None,
    nvme_free: str | int | None,
    nvme_path: Path,
) -> tuple[dict[Tier, int | None], list[str], str]:
    """The given sizes, else what `tierzero train` would take on this machine
    (`default_budgets`: half the free RAM, 90% of GPU 0's free memory, the free space
    at `nvme_path`); a note per size that was detected; and the compute device's kind ("cpu"
    without CUDA and without --gpu-mem, where the gpu tier is host memory inside the host
    budget)."""
    detected = []
    device = "cuda" if gpu_mem is not None or torch.cuda.is_available() else "cpu"
    host = parse_bytes(host_mem, "--host-mem") if host_mem is not None else None
    gpu = parse_bytes(gpu_mem, "--gpu-mem") if gpu_mem is not None else None
    if host is None or (gpu is None and device == "cuda"):
        host_default, gpu_default = default_budgets(
            torch.device("cuda", 0) if device == "cuda" and gpu is None else torch.device("cpu")
        )
        if host is None:
            host = host_default
            detected.append("host")
        if gpu is None and device == "cuda":
            gpu = gpu_default
            detected.append("gpu")
    if gpu is None and device == "cpu":
        detected.append("gpu (host memory, no CUDA)")
    nvme = parse_bytes(nvme_free, "--nvme-free") if nvme_free is not None else None
    if nvme is None:
        if not nvme_path.is_dir():
            raise ConfigError(
                f"--nvme-path '{nvme_path}' is not a directory; give an existing one or --nvme-free"
            )
        nvme = free_disk_bytes([nvme_path])
        detected.append("nvme")
    return {Tier.GPU: gpu, Tier.HOST: host, Tier.NVME: nvme}, detected, device


def process_written_bytes() -> int | None:
    """Bytes this process has caused to be written to storage (Linux /proc/self/io: write_bytes
    less cancelled_write_bytes, page-cache writes truncated before they reached a disk); None
    where the kernel does not say. Writes to tmpfs reach no disk and are not counted."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(fields["write_bytes"]) - int(fields.get("cancelled_write_bytes", 0))
    except (OSError, KeyError, ValueError):
        return None
