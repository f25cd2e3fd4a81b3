"""The cost of a re-step: exact clipping with the optimizer step beside backward.

With overlap_step and clip_grad_norm each unit is stepped unclipped as its grad arrives, from a
kept generation; where the clip fires, every piece is stepped again with the coefficient once the
global norm is known. Measured side by side, host and nvme homes, a tiny model, median step time:

- separate step: overlap_step off, the clip firing (the step waits for the norm, steps once);
- overlap, clip not firing (max norm 1e6): one step, plus copying the kept generation;
- overlap, clip firing (max norm 1e-3): the speculative step, then the re-step.

    python benchmarks/restep.py --layers 4 --dim 256
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table
from shapes import add_shape_flags, shape

from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.models import ModelArgs
from tierzero.run.data import TokenBatches, default_corpus

PLACEMENTS = {
    "host": Placement(Tier.GPU, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST),
    "nvme": Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME),
}
VARIANTS = {
    "separate step, clip fires": (False, 1e-3),
    "overlap, clip does not fire": (True, 1e6),
    "overlap, clip fires (re-step)": (True, 1e-3),
}


def step_times(
    args: ModelArgs,
    placement: Placement,
    overlap: bool,
    clip: float,
    a: argparse.Namespace,
    path: str,
) -> tuple[list[float], tuple[float, float]]:
    """Step times after a warm-up step, and nvme bytes read and written per step."""
    cfg = Config(
        placement=placement,
        nvme_path=[path],
        lr=1e-4,
        total_steps=a.steps + 2,
        overlap_step=overlap,
        clip_grad_norm=clip,
    )
    data = TokenBatches(default_corpus(4 << 20), a.batch_size, a.seq_len, seed=0)
    times = []
    with Engine(models.build(args, device="meta"), cfg) as engine:
        engine.train_step(data.next_batch())  # warm-up: allocator, page cache, threads
        engine.stats()
        for _ in range(a.steps):
            t0 = time.perf_counter()
            engine.train_step(data.next_batch())
            times.append(time.perf_counter() - t0)
        stats = engine.stats()
    return times, (
        stats.get("bytes_nvme->host", 0) / a.steps,
        stats.get("bytes_host->nvme", 0) / a.steps,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_flags(p, layers=4, dim=256, batch_size=4, seq_len=128)
    p.add_argument("--path", default=None, help="NVMe directory (default: a temp dir under .)")
    a = p.parse_args()
    args = shape(a)
    console = Console(width=120)
    n = args.param_count()
    console.print(
        f"model: {a.layers} layers x dim {a.dim} = {n / 1e6:.2f}M params; batch {a.batch_size} x "
        f"{a.seq_len}; torch threads {torch.get_num_threads()}; kept copies: host homes "
        f"{16 * n / 1e6:.0f} MB (grad, master, moments), nvme homes {4 * n / 1e6:.0f} MB (grad; "
        "master and moments held on the drive)"
    )
    samples: dict[tuple[str, str], list[float]] = {}
    moved: dict[tuple[str, str], tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(dir=a.path or ".") as root:
        for r in range(a.rounds):
            for home, placement in PLACEMENTS.items():
                for name, (overlap, clip) in VARIANTS.items():
                    times, nbytes = step_times(
                        args, placement, overlap, clip, a, f"{root}/{r}-{home}-{name[:8]}"
                    )
                    samples.setdefault((home, name), []).extend(times)
                    moved[(home, name)] = nbytes
    table = Table(title="step time, median over interleaved rounds")
    for col in (
        "homes",
        "variant",
        "step s",
        "vs not firing",
        "nvme read / step",
        "nvme written / step",
    ):
        table.add_column(col, justify="left" if col in ("homes", "variant") else "right")
    for (home, name), times in samples.items():
        t = statistics.median(times)
        base = statistics.median(samples[(home, "overlap, clip does not fire")])
        read, written = moved[(home, name)]
        table.add_row(
            home,
            name,
            f"{t:.3f}",
            f"{t / base:.2f}x",
            f"{read / 1e6:,.1f} MB",
            f"{written / 1e6:,.1f} MB",
        )
    console.print(table)


if __name__ == "__main__":
    main()
