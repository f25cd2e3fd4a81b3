"""What recomputing costs: `--recompute auto` (keep what the budget holds) against `all`.

Two engines train the same batches side by side, one step each in turn (interleaved, so load
from other processes falls on both alike), fp32 on the CPU device with every state in RAM and a
budget that holds every block's activations. It prints each step's wall time and this
process's CPU time (on a shared machine the CPU time is the steadier figure), the ratios of
auto's to all's, which units `auto` kept and what the memory model counts for them, and whether
the final weights are bitwise equal.

    python benchmarks/recompute.py            # 134M: dim 768, 12 layers, vocab 32000, untied
    python benchmarks/recompute.py --quick    # a small shape, in seconds
    python benchmarks/recompute.py --accumulate 4   # the vertical schedule: k graphs a block
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from contextlib import ExitStack

import torch

from tierzero import Config, models
from tierzero.bench.shapes import NVME_SHAPE, QUICK_SHAPE
from tierzero.engine import Engine
from tierzero.run.data import TokenBatches, default_corpus

MODES = ("all", "auto")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="a small shape (4 layers, dim 256, vocab 4096)"
    )
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument(
        "--steps", type=int, default=4, help="timed steps per engine, after one warm-up step each"
    )
    p.add_argument("--host-budget", default="8GiB")
    p.add_argument(
        "--accumulate", type=int, default=1, help="micro-batches a step (> 1: vertically)"
    )
    return p.parse_args()


def race(
    engines: dict[str, Engine], data: dict[str, TokenBatches], steps: int, accumulate: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """One warm-up step each, then `steps` steps each, the engines taking turns (which goes first
    alternates); per mode the wall and this process's CPU seconds of every timed step."""
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    for step in range(steps + 1):
        for mode in MODES if step % 2 == 0 else MODES[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(accumulate):
                engines[mode].train_micro_batch(data[mode].next_batch())
            if step:  # the first step of each is a warm-up
                times[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
        if step:
            each = ", ".join(
                f"{m} {times[m][-1]:.2f} s wall, {cpu[m][-1]:.2f} s CPU" for m in times
            )
            print(f"  step {step}: {each}")
    return times, cpu


def print_kept(auto: Engine) -> None:
    """Which units `auto` kept the activations of, and what the memory model counts for them."""
    act = auto.parts.sizing.activations
    head = f" + the head {act.head_kept_bytes / 1e6:.1f} MB" if act.kept_head else ""
    graphs = f" ({act.vertical} micro-batches' graphs each, vertically)" if act.vertical else ""
    print(
        f"auto kept units {sorted(auto.opened.runner.keeping.units)} of {len(auto.units)}: "
        f"{act.kept_blocks} blocks x {act.block_kept_bytes / 1e6:.1f} MB{graphs}{head} = "
        f"{act.kept_bytes / 1e6:.1f} MB counted by the memory model"
    )


def print_ratios(what: str, t: dict[str, list[float]]) -> None:
    ratios = [b / a for a, b in zip(t["all"], t["auto"])]
    print(
        f"{what}: median step all {statistics.median(t['all']):.2f} s, "
        f"auto {statistics.median(t['auto']):.2f} s; "
        f"auto/all per step {', '.join(f'{r:.3f}' for r in ratios)}; "
        f"median {statistics.median(ratios):.3f}, total {sum(t['auto']) / sum(t['all']):.3f}"
    )


def main() -> None:
    opts = parse_args()
    # 134.1M, or the quick stand-in
    shape = QUICK_SHAPE if opts.quick else NVME_SHAPE
    args = dataclasses.replace(shape, max_seq_len=max(opts.seq_len, 2048))
    torch.manual_seed(0)
    print(
        f"{args.param_count() / 1e6:.1f}M params, fp32, every state in RAM (the CPU device), "
        f"micro-batch {opts.batch_size} x {opts.seq_len}, {opts.accumulate} a step, "
        f"host budget {opts.host_budget}, "
        f"torch threads {torch.get_num_threads()}"
    )
    with ExitStack() as stack:
        engines, data = {}, {}
        for mode in MODES:
            cfg = Config(
                nvme_path=[stack.enter_context(tempfile.TemporaryDirectory())],
                dtype="fp32",
                lr=1e-4,
                total_steps=opts.steps + 1,
                recompute=mode,
                host_budget=opts.host_budget,
                accumulate=opts.accumulate,
            )
            model = models.build(args, device="meta", seed=0)
            engines[mode] = stack.enter_context(Engine(model, cfg))
            data[mode] = TokenBatches(
                default_corpus(4 << 20), opts.batch_size, opts.seq_len, seed=0
            )
        times, cpu = race(engines, data, opts.steps, opts.accumulate)
        print_kept(engines["auto"])
        weights = {m: e.master_state_dict() for m, e in engines.items()}
    same = all(torch.equal(weights["all"][k], weights["auto"][k]) for k in weights["all"])
    print_ratios("wall", times)
    print_ratios("CPU", cpu)
    print(f"final weights bitwise equal: {same}")


if __name__ == "__main__":
    main()
