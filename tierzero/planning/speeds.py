"""Measurements of this machine that do not touch a disk: the inputs of the step-time model.

CPU AdamW throughput (the optimizer runs on CPU over streamed shards), matmul TFLOP/s in fp32
and bf16 (forward/backward compute), and host->GPU copy bandwidth from pinned and pageable
memory. Each measurement repeats its operation until `seconds` have passed (at least twice,
the first run being a warm-up) and reports the best rate. The disk side lives in
`tierzero.planning.diskbench`; only the CLI prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tierzero.config import PIECE_NUMEL
from tierzero.storage.host import HostPool


def _best_seconds(op: Callable[[], None], seconds: float, sync: Callable[[], None]) -> float:
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


def adam_params_per_s(numel: int = PIECE_NUMEL, seconds: float = 0.5) -> float:
    """Parameters per second through one fused CPU `torch.optim.AdamW` step on fp32 state.

    By default on one piece, what the engine's optimizer steps at a time: its four fp32 tensors
    (256 MiB) stream from memory as the engine's do. A few million elements would sit in the
    CPU's last-level cache and run several times faster than any real step (1.83e9 against
    5.8e8 params/s for 4Mi against 32Mi elements on one machine)."""
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    opt = torch.optim.AdamW([param], lr=1e-4, fused=True)
    return numel / _best_seconds(opt.step, seconds, _no_sync)


def matmul_tflops(dtype: torch.dtype, n: int = 1024, seconds: float = 0.5,
                  device: torch.device | str = "cpu") -> float:
    """TFLOP/s of an n x n x n matmul (2 n^3 flops) in `dtype` on `device`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else _no_sync
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b, out=out), seconds, sync) / 1e12


def h2d_gbps(nbytes: int = 256 << 20, pinned: bool = True, seconds: float = 0.5,
             to_host: bool = False) -> float:
    """GB/s of one host->GPU (or, `to_host`, GPU->host) copy of `nbytes` between pinned or
    pageable memory and the current GPU (needs CUDA).

    The host buffer comes from a `HostPool`, so the figure is that of the engine's own
    (registered) pinned blocks."""
    with HostPool(nbytes, pin=pinned) as pool:
        host = pool.lease(nbytes).fill_(1)
        gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst, src = (host, gpu) if to_host else (gpu, host)
        # non_blocking only with pinned memory: with pageable memory it would copy synchronously.
        op = lambda: dst.copy_(src, non_blocking=pinned)
        gbps = nbytes / _best_seconds(op, seconds, torch.cuda.synchronize) / 1e9
        pool.give_back(host)
    return gbps
