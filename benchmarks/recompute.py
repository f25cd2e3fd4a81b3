"""What recomputing costs: `--recompute auto` (keep what the budget holds) against `all`.

Two engines train the same batches side by side, one step each in turn (interleaved, so load
from other processes falls on both alike), fp32 on the CPU device with every state in RAM and a
budget that holds every block's activations. It prints each step's wall time and this
process's CPU time (on a shared machine the CPU time is the steadier figure), the ratios of
auto's to all's, which units `auto` kept and what the memory model counts for them, and whether
the final weights are bitwise equal.

    python benchmarks/recompute.py            # 134M: dim 768, 12 layers, vocab 32000, untied
    python benchmarks/recompute.py --quick    # a small shape, in seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch

from tierzero import Config, models
from tierzero.engine import Engine
from tierzero.models import ModelArgs
from tierzero.run.data import TokenBatches, default_corpus


def main() -> None:
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
    opts = p.parse_args()
    args = ModelArgs(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        vocab_size=32000,
        ffn_dim=2048,
        max_seq_len=max(opts.seq_len, 2048),
    )  # 134.1M
    if opts.quick:
        args = dataclasses.replace(
            args, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=4096
        )
    torch.manual_seed(0)
    print(
        f"{args.param_count() / 1e6:.1f}M params, fp32, every state in RAM (the CPU device), micro-batch "
        f"{opts.batch_size} x {opts.seq_len}, host budget {opts.host_budget}, torch threads {torch.get_num_threads()}"
    )
    with tempfile.TemporaryDirectory() as a_dir, tempfile.TemporaryDirectory() as b_dir:
        engines, data = {}, {}
        times: dict[str, list[float]] = {"all": [], "auto": []}  # wall seconds per step
        cpu: dict[str, list[float]] = {"all": [], "auto": []}  # this process's CPU seconds per step
        for mode, path in (("all", a_dir), ("auto", b_dir)):
            cfg = Config(
                nvme_path=[path],
                dtype="fp32",
                lr=1e-4,
                total_steps=opts.steps + 1,
                recompute=mode,
                host_budget=opts.host_budget,
            )
            engines[mode] = Engine(models.build(args, device="meta", seed=0), cfg).__enter__()
            data[mode] = TokenBatches(
                default_corpus(4 << 20), opts.batch_size, opts.seq_len, seed=0
            )
        try:
            for step in range(opts.steps + 1):
                for mode in ("all", "auto") if step % 2 == 0 else ("auto", "all"):
                    t0, c0 = time.perf_counter(), time.process_time()
                    engines[mode].train_step(data[mode].next_batch())
                    if step:  # the first step of each is a warm-up
                        times[mode].append(time.perf_counter() - t0)
                        cpu[mode].append(time.process_time() - c0)
                if step:
                    print(
                        f"  step {step}: "
                        + ", ".join(
                            f"{m} {times[m][-1]:.2f} s wall, {cpu[m][-1]:.2f} s CPU" for m in times
                        )
                    )
            auto = engines["auto"]
            act = auto.sizing.activations
            head = f" + the head {act.head_kept_bytes / 1e6:.1f} MB" if act.kept_head else ""
            print(
                f"auto kept units {sorted(auto.runner.kept)} of {len(auto.units)}: {act.kept_blocks} blocks x "
                f"{act.recompute_bytes / 1e6:.1f} MB{head} = {act.kept_bytes / 1e6:.1f} MB counted by the memory model"
            )
            weights = {m: e.master_state_dict() for m, e in engines.items()}
        finally:
            for e in engines.values():
                e.close()
    same = all(torch.equal(weights["all"][k], weights["auto"][k]) for k in weights["all"])
    for what, t in (("wall", times), ("CPU", cpu)):
        ratios = [b / a for a, b in zip(t["all"], t["auto"])]
        print(
            f"{what}: median step all {statistics.median(t['all']):.2f} s, auto {statistics.median(t['auto']):.2f} s; "
            f"auto/all per step {', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}, "
            f"total {sum(t['auto']) / sum(t['all']):.3f}"
        )
    print(f"final weights bitwise equal: {same}")


if __name__ == "__main__":
    main()
