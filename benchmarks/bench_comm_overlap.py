"""How well two ranks hide their collectives behind compute, with a slow link injected.

Two gloo ranks on this machine train the same model with every state in memory (all-gpu: no
tier traffic), so a step is compute plus collectives. Each collective is slowed to a link of
one bandwidth: collectives cross it one after another, in the order they were issued, each
taking bytes / bandwidth, and a result is ready only once its transfer is over (the delay runs
beside whatever the rank does meanwhile, as a real transfer would). The bandwidth is set so
that the injected communication per step is `--balance` times the compute step (default: 0.5,
1 and 2, one row each).

    compute        the step with no delay (gloo on one machine: collectives nearly free)
    comm           the injected delays of one step, summed (every all-gather and reduce-scatter)
    no overlap     --no-overlap-comm: each all-gather waited for before its unit computes, each
                   reduce-scatter before the next unit's backward starts: about compute + comm
    overlap        the default: the next unit's all-gather issued as a unit starts computing, a
                   unit's reduce-scatter finished after the next unit's backward

and prints step / max(compute, comm) for both (1.0: communication fully hidden).

    python benchmarks/bench_comm_overlap.py --layers 8 --dim 384 --batch-size 4 --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from shapes import add_shape_flags, shape

from tierzero import Config, Placement, models
from tierzero.distributed.comm import InFlight
from tierzero.engine import Engine
from tierzero.models import ModelArgs
from tierzero.run.data import TokenBatches, default_corpus


class SlowLink:
    """Wraps a rank's `Comm` so collectives cross one link of `bytes_per_s`, in issue order: a
    result is ready when its transfer, started once the link is free, is over. Counts the
    injected seconds."""

    def __init__(self, comm: Any, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.injected_s = 0.0
        self.free_at = 0.0  # when the link has finished every transfer issued so far
        gather, reduce = comm.all_gather_async, comm.reduce_scatter_async
        comm.all_gather_async = lambda shard: self._slow(
            gather(shard), shard.numel() * comm.world_size * shard.element_size()
        )
        comm.reduce_scatter_async = lambda full: self._slow(reduce(full), full.numel() * 4)

    def _slow(self, inner: InFlight, nbytes: int) -> Any:
        delay = nbytes / self.bytes_per_s
        self.injected_s += delay
        self.free_at = max(self.free_at, time.perf_counter()) + delay
        return _Delayed(inner, self.free_at)


class _Delayed:
    def __init__(self, inner: InFlight, ready_at: float) -> None:
        self.inner, self.ready_at = inner, ready_at

    def wait(self) -> torch.Tensor:
        time.sleep(max(0.0, self.ready_at - time.perf_counter()))
        return self.inner.wait()


def _steps(
    args: ModelArgs,
    a: argparse.Namespace,
    rank: int,
    overlap: bool,
    bytes_per_s: float | None,
    root: str,
) -> tuple[float, float]:
    """Median step time and injected comm seconds per step, for one variant."""
    cfg = Config(
        placement=Placement(),
        nvme_path=[root],
        lr=1e-4,
        total_steps=a.steps + 2,
        overlap_comm=overlap,
        dtype="fp32",
    )
    data = TokenBatches(
        default_corpus(4 << 20), a.batch_size, a.seq_len, seed=0, rank=rank, world_size=2
    )
    times = []
    with Engine(models.build(args, device="meta"), cfg) as engine:
        engine.train_step(data.next_batch())  # warm-up: allocator, threads, first gathers
        link = SlowLink(engine.parts.layout.comm, bytes_per_s) if bytes_per_s else None
        for _ in range(a.steps):
            dist.barrier()
            t0 = time.perf_counter()
            engine.train_step(data.next_batch())
            times.append(time.perf_counter() - t0)
        injected = link.injected_s / a.steps if link else 0.0
    return statistics.median(times), injected


def _rank(rank: int, a: argparse.Namespace, root: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2
    )
    try:
        args = shape(a)
        rows: dict[str, list[list[float]]] = {"compute": []}
        links: dict[float, float] = {}  # balance -> bytes per second
        for r in range(a.rounds):
            rows["compute"].append(list(_steps(args, a, rank, True, None, f"{root}/c{r}")))
            if not links:  # bytes per step, measured once through a link too fast to matter
                nbytes = _steps(args, a, rank, True, 1e15, f"{root}/p")[1] * 1e15
                links = {b: nbytes / (b * rows["compute"][0][0]) for b in a.balance}
            for b, bytes_per_s in links.items():
                for name, overlap in ((f"{b:g} no overlap", False), (f"{b:g} overlap", True)):
                    rows.setdefault(name, []).append(
                        list(
                            _steps(
                                args,
                                a,
                                rank,
                                overlap,
                                bytes_per_s,
                                f"{root}/{name.replace(' ', '-')}{r}",
                            )
                        )
                    )
        if rank == 0:
            with open(f"{root}/result.json", "w") as f:
                json.dump(
                    {
                        "params": args.param_count(),
                        "balance": a.balance,
                        "link_gbps": {f"{b:g}": v / 1e9 for b, v in links.items()},
                        "rows": rows,
                    },
                    f,
                )
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_flags(
        p,
        layers=8,
        dim=384,
        batch_size=4,
        seq_len=128,
        batch_help="the global batch (2 rows per rank)",
    )
    p.add_argument(
        "--balance",
        type=float,
        nargs="+",
        default=[0.5, 1.0, 2.0],
        help="injected comm per step / the compute step, one row each",
    )
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        mp.spawn(_rank, args=(a, root), nprocs=2, join=True)
        with open(f"{root}/result.json") as f:
            result = json.load(f)
    _print(result)


def _print(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    med = {k: statistics.median(t for t, _ in v) for k, v in result["rows"].items()}
    compute = med["compute"]
    console = Console()
    console.print(
        f"{result['params'] / 1e6:.1f}M params, 2 gloo ranks, every state in memory; "
        f"compute step (no delay) {compute:.3f} s"
    )
    table = Table(title="step time (median over interleaved rounds) / max(compute, comm)")
    for col in ("comm / compute", "link GB/s", "comm s", "compute + comm", "no overlap", "overlap"):
        table.add_column(col, justify="right")
    for b in result["balance"]:
        key = f"{b:g}"
        comm = statistics.median(c for _, c in result["rows"][f"{key} overlap"])
        bound = max(compute, comm)
        table.add_row(
            key,
            f"{result['link_gbps'][key]:.4f}",
            f"{comm:.3f}",
            f"{(compute + comm) / bound:.2f}",
            f"{med[f'{key} no overlap']:.3f} s = {med[f'{key} no overlap'] / bound:.2f}",
            f"{med[f'{key} overlap']:.3f} s = {med[f'{key} overlap'] / bound:.2f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
