"""How fast the compact optimizer step runs on the CPU, against torch's fused fp32 AdamW.

For each format combination (fp32 / bf16 / int8 moments x fp32 / bf16 master) this steps one
piece (16M values by default) with `CompactStep` (on the CPU its compiled kernel, or with
`--torch-ops` the torch ops it falls back to) and, interleaved round by round so a noisy
machine slows both alike, the same piece's fp32 state with torch's fused AdamW
(`tierzero.adamw.adamw_step`). It prints the median M params/s of each and their ratio.
fp32 master and moments are not a compact step (the engine runs torch's AdamW for them), but
the row shows the compact step's own cost.

    nice python benchmarks/compact_step.py              # 16M values, 5 rounds
    nice python benchmarks/compact_step.py --numel 4000000 --rounds 3
    nice python benchmarks/compact_step.py --torch-ops  # the fallback
    nice python benchmarks/compact_step.py --cpu-time   # CPU seconds, not wall-clock ones
    nice python benchmarks/compact_step.py --phases     # each phase of the kernel alone
    nice python benchmarks/compact_step.py --grad bf16  # bf16 grads, as a bf16 run steps them
    nice python benchmarks/compact_step.py --beside-matmuls  # int8 + bf16 alone, then beside
                                                             # a thread of bf16 matmuls

On a machine others load, `--cpu-time` (the process's CPU time, every thread's) moves far less
from run to run than the wall clock; with one thread (`torch.set_num_threads`, `--threads 1`)
it is the per-value cost of each path.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from functools import partial

import torch

from tierzero.adamw import adamw_step
from tierzero.compact.formats import StateFormats
from tierzero.compact.step import CompactStep
from tierzero.config import TORCH_DTYPES, Config, DType, StateKind

FORMATS = [(m, w) for m in ("fp32", "bf16", "int8") for w in ("fp32", "bf16")]  # (moments, master)


def compact_tensors(
    formats: StateFormats, n: int, grad: torch.dtype = torch.float32
) -> dict[StateKind, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        StateKind.MASTER: formats.encode(StateKind.MASTER, torch.randn(n, generator=g) * 0.05),
        StateKind.EXP_AVG: formats.encode(StateKind.EXP_AVG, torch.randn(n, generator=g) * 1e-3),
        StateKind.EXP_AVG_SQ: formats.encode(
            StateKind.EXP_AVG_SQ, torch.rand(n, generator=g) * 1e-6
        ),
        StateKind.GRAD: (torch.randn(n, generator=g) * 1e-2).to(grad),
    }


def timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def phases(n: int = 8192, calls: int = 2000) -> None:
    """Each of the kernel's phases alone on one chunk of `n` values (what a core steps at a
    time), called directly, one thread: the best of 5 x `calls`, in ns a value."""
    import numpy as np

    from tierzero.compact import cpu_kernel as k

    rng = np.random.default_rng(0)
    values = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    codes, b16 = np.zeros(n, np.uint8), np.zeros(n, np.uint16)
    scales, out, work = np.ones(n // 256, np.float32), np.zeros(n, np.float32), values.copy()
    no16, no8, no32 = np.zeros(0, np.uint16), np.zeros(0, np.uint8), np.zeros(0, np.float32)
    scalars = np.array([1, 0.9, 0.1, 0.999, 0.001, 0.5, 1e-8, 1e-3], np.float32)
    p, m, v, g = values.copy(), values.copy(), np.abs(values), values.copy()
    cases = {
        "int8 moment, encode (block absmax and codes)": lambda: k._encode(
            work, bits, k.LOW_HALF, k.INT8, no16, codes, scales, 1
        ),
        "int8 moment, decode": lambda: k._decode(out, k.INT8, no16, codes, scales, 1),
        "bf16 state, encode": lambda: k._encode(work, bits, k.LOW_HALF, k.BF16, b16, no8, no32, 0),
        "bf16 state, decode": lambda: k._decode(out, k.BF16, b16, no8, no32, 0),
        "random bits (one hash)": lambda: k._fill_bits(bits, 12345, 77),
        "AdamW with its sqrt": lambda: k._adamw(p, m, v, g, scalars),
    }
    for name, fn in cases.items():
        fn()  # compiled, or loaded from numba's cache
        best = min(timed(lambda fn=fn: [fn() for _ in range(calls)]) for _ in range(5))
        print(f"{name:<46} {best / calls / n * 1e9:6.3f} ns a value")


def beside_matmuls(n: int, rounds: int, grad: torch.dtype) -> None:
    """The int8 + bf16 step alone, then while another thread of this process runs bf16 matmuls
    with short gaps (as backward runs beside the optimizer's thread): its median M params/s
    each way, and the matmuls' GFLOP/s meanwhile."""
    config = Config(lr=1e-3, weight_decay=0.1, seed=7)
    formats = StateFormats("int8", "bf16")
    stepper = CompactStep(formats, config.optimizer, config.seed, torch.device("cpu"))
    tensors = compact_tensors(formats, n, grad)

    def rate(r0: int) -> float:
        times = [
            timed(partial(stepper.step, tensors, [(0, n, 0.1, r)], 1e-3, 0, 0))
            for r in range(r0, r0 + rounds)
        ]
        return n / statistics.median(times) / 1e6

    stop, flops = threading.Event(), [0.0]

    def matmuls() -> None:
        a, b = (torch.randn(1024, 1024, dtype=torch.bfloat16) for _ in range(2))
        while not stop.is_set():
            a @ b
            flops[0] += 2 * 1024**3
            time.sleep(0.0005)

    alone = rate(0)
    thread = threading.Thread(target=matmuls)
    start = time.perf_counter()
    thread.start()
    beside = rate(rounds)
    stop.set()
    thread.join()
    gflops = flops[0] / (time.perf_counter() - start) / 1e9
    print(
        f"int8 + bf16, {n} values, median of {rounds}: alone {alone:.1f} M params/s, beside "
        f"matmuls {beside:.1f} ({beside / alone:.3f}x; the matmuls {gflops:.0f} GFLOP/s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--torch-ops", action="store_true", help="step with torch's ops, not the kernel"
    )
    parser.add_argument(
        "--cpu-time", action="store_true", help="time CPU seconds, not wall-clock ones"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch's (and the kernel's) threads")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="each phase of the kernel alone on one chunk, ns a value",
    )
    parser.add_argument(
        "--grad",
        choices=("fp32", "bf16"),
        default="fp32",
        help="the compact rows' grad dtype (a bf16 run's grads are bf16; fused AdamW's fp32)",
    )
    parser.add_argument(
        "--beside-matmuls",
        action="store_true",
        help="int8 + bf16 alone, then beside a thread of bf16 matmuls",
    )
    opts = parser.parse_args()
    if opts.phases:
        phases()
        return
    if opts.beside_matmuls:
        beside_matmuls(opts.numel, opts.rounds, TORCH_DTYPES[DType(opts.grad)])
        return
    if opts.threads:
        torch.set_num_threads(opts.threads)
    clock = time.process_time if opts.cpu_time else time.perf_counter
    n, config = opts.numel, Config(lr=1e-3, weight_decay=0.1, seed=7)
    # param, grad, exp_avg, exp_avg_sq: one tensor each, as lists the way adamw_step takes them
    fused = [[torch.randn(n) * 0.05], [torch.randn(n) * 1e-2], [torch.zeros(n)], [torch.zeros(n)]]
    cpu = torch.device("cpu")
    steps = {
        f: (
            CompactStep(
                StateFormats(*f), config.optimizer, config.seed, cpu, kernel=not opts.torch_ops
            ),
            compact_tensors(StateFormats(*f), n, TORCH_DTYPES[DType(opts.grad)]),
        )
        for f in FORMATS
    }
    times: dict[tuple[str, str] | str, list[float]] = {key: [] for key in [*FORMATS, "fused"]}
    for r in range(opts.rounds + 1):  # round 0 warms up the scratch and allocator
        for f, (stepper, tensors) in steps.items():
            # the fused fp32 step and this format's, both at step r, one after the other
            fused_step = partial(adamw_step, *fused, [0.1], [r], 1e-3, config.optimizer)
            compact_step = partial(stepper.step, tensors, [(0, n, 0.1, r)], 1e-3, 0, 0)
            for key, fn in (("fused", fused_step), (f, compact_step)):
                elapsed = timed(fn, clock)
                if r:
                    times[key].append(elapsed)
    rate = {key: n / statistics.median(t) / 1e6 for key, t in times.items()}
    path = "torch's ops" if opts.torch_ops else "the CPU kernel"
    per = "CPU second" if opts.cpu_time else "second"
    print(
        f"{n} values, {torch.get_num_threads()} threads, median of {opts.rounds} interleaved "
        f"rounds, {path}, {opts.grad} grads, M params per {per}"
    )
    print(f"torch fused AdamW (fp32): {rate['fused']:8.1f}")
    print(f"{'moments':>8} {'master':>7} {'M params':>11} {'vs fused':>9}")
    for f in FORMATS:
        print(f"{f[0]:>8} {f[1]:>7} {rate[f]:11.1f} {rate[f] / rate['fused']:9.3f}")


if __name__ == "__main__":
    main()
