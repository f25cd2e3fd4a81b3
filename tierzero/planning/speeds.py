"""Measurements of this machine that do not touch a disk: the inputs of the step-time model.

CPU AdamW throughput (the optimizer runs on CPU over streamed shards; for compact state, the
compact step's), matmul TFLOP/s in fp32
and bf16 (forward/backward compute), and host->GPU copy bandwidth from pinned and pageable
memory. Each measurement repeats its operation until `seconds` have passed (at least twice,
the first run being a warm-up) and reports the best rate. The disk side lives in
`tierzero.planning.diskbench`; only the CLI prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from tierzero.config import PIECE_NUMEL, OptimizerSettings, StateKind
from tierzero.planning.statebytes import StateBytes
from tierzero.storage.host import HostPool


def best_seconds(op: Callable[[], None], seconds: float, sync: Callable[[], None]) -> float:
    """The fastest of repeated runs of `op` (after one warm-up), repeated for `seconds`."""
    op()
    sync()
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        op()
        sync()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() >= deadline:
            return best


def _no_sync() -> None:
    pass


ADAM_STATE_BYTES = 16  # fp32 param, grad, exp_avg and exp_avg_sq per parameter
CACHE_MARGIN = 4  # the timed state is at least this many times the last-level cache


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The largest CPU cache sysfs reports (Linux), or None where it reports none."""
    sizes = []
    for entry in root.glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=None)


def adam_timing_numel(cache_bytes: int | None = None) -> int:
    """Parameters whose fp32 AdamW state outgrows the last-level cache `CACHE_MARGIN` times over,
    and never fewer than one piece: what the engine's optimizer streams from memory at a time.
    Some machines report a cache of hundreds of MiB, where one piece would still sit in it."""
    cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    return max(PIECE_NUMEL, -(-CACHE_MARGIN * (cache_bytes or 0) // ADAM_STATE_BYTES))


def adam_params_per_s(numel: int | None = None, seconds: float = 0.5) -> float:
    """Parameters per second through one fused CPU `torch.optim.AdamW` step on fp32 state.

    By default on `adam_timing_numel()` parameters, at least one piece: the state streams from
    memory as the engine's does. A few million elements would sit in the CPU's last-level cache
    and run several times faster than any real step (1.83e9 against 5.8e8 params/s for 4Mi
    against 32Mi elements on one machine)."""
    numel = adam_timing_numel() if numel is None else numel
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    opt = torch.optim.AdamW([param], lr=1e-4, fused=True)
    return numel / best_seconds(opt.step, seconds, _no_sync)


def optimizer_params_per_s(formats: StateBytes, seconds: float = 0.5) -> float:
    """Parameters per second through the host's optimizer step on state stored as `formats`:
    fused AdamW for fp32 state (`adam_params_per_s`), else the compact step (its CPU kernel,
    as the engine runs it) on one piece beyond the cache, fp32 grads."""
    if not formats.compact:
        return adam_params_per_s(seconds=seconds)
    from tierzero.compact.formats import StateFormats
    from tierzero.compact.step import CompactStep

    numel = adam_timing_numel()
    stored = StateFormats(formats.optimizer_state, formats.master)
    g = torch.Generator().manual_seed(0)
    tensors = {
        kind: stored.encode(kind, torch.randn(numel, generator=g).abs_() * 1e-3)
        for kind in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    }
    tensors[StateKind.GRAD] = torch.randn(numel, generator=g)
    step = CompactStep(stored, OptimizerSettings(), 0, torch.device("cpu"))
    spans = [(0, numel, 0.0, 0)]
    return numel / best_seconds(lambda: step.step(tensors, spans, 1e-4, 0, 0), seconds, _no_sync)


def matmul_tflops(
    dtype: torch.dtype, n: int = 1024, seconds: float = 0.5, device: torch.device | str = "cpu"
) -> float:
    """TFLOP/s of an n x n x n matmul (2 n^3 flops) in `dtype` on `device`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else _no_sync
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b, out=out), seconds, sync) / 1e12


def h2d_gbps(
    nbytes: int = 256 << 20, pinned: bool = True, seconds: float = 0.5, to_host: bool = False
) -> float:
    """GB/s of one host->GPU (or, `to_host`, GPU->host) copy of `nbytes` between pinned or
    pageable memory and the current GPU (needs CUDA).

    The host buffer comes from a `HostPool`, so the figure is that of the engine's own
    (registered) pinned blocks."""
    with HostPool(nbytes, pin=pinned) as pool:
        host = pool.lease(nbytes).fill_(1)
        gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst, src = (host, gpu) if to_host else (gpu, host)
        # non_blocking only with pinned memory: with pageable memory it would copy synchronously.

        def op() -> torch.Tensor:
            return dst.copy_(src, non_blocking=pinned)

        gbps = nbytes / best_seconds(op, seconds, torch.cuda.synchronize) / 1e9
        pool.give_back(host)
    return gbps
