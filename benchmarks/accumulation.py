"""What gradient accumulation costs in NVMe traffic: the horizontal and vertical schedules side
by side.

With everything on NVMe, horizontally each extra micro-batch of a step reads every param twice
more and reads and writes every unit's fp32 grad again; vertically (`--schedule vertical`)
each unit's params are read once per pass and its grad written once per step, whatever k is.
For k = 1, 4, 16 and both schedules this runs one step (after one warm-up step at k = 1 per
schedule, which fills the page cache and allocator) and prints NVMe bytes per parameter per
step (read + written, and any param bytes the host cache served instead of NVMe) and the
step's time, and the ratio of vertical's bytes at k = 16 to its bytes at k = 1.

    python benchmarks/accumulation.py            # 134M: GPT-3 small's shape, LLaMA blocks,
                                                 #   vocab 32000, untied
    python benchmarks/accumulation.py --quick    # a small shape, in seconds
    python benchmarks/accumulation.py --model hf:DIR [--quick]   # a Hugging Face decoder

`--model hf:DIR` trains the directory's model (its weights, or its own init without them);
a DIR without config.json gets one: a `LlamaForCausalLM` of the same shape (134M; `--quick`:
the small one), written there with `save_pretrained` (config only).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tierzero import Config, Placement, Tier, models
from tierzero.bench.shapes import nvme_shape
from tierzero.engine import Engine
from tierzero.hf import is_hf, load_model
from tierzero.models import ModelArgs
from tierzero.run.data import TokenBatches, default_corpus

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
ACCUMULATIONS = (1, 4, 16)


Model = Callable[[], tuple[object, Path | None]]  # a fresh model (on meta) and its weights


def hf_model(name: str, args: ModelArgs) -> Model:
    """`hf:DIR`'s model; a DIR without config.json first gets a LLaMA config of `args`' shape."""
    path = Path(name[len("hf:") :])
    if not (path / "config.json").is_file():
        from transformers import LlamaConfig

        LlamaConfig(
            hidden_size=args.dim,
            intermediate_size=args.ffn_dim,
            num_hidden_layers=args.n_layers,
            num_attention_heads=args.n_heads,
            num_key_value_heads=args.n_kv_heads,
            vocab_size=args.vocab_size,
            tie_word_embeddings=False,
            max_position_embeddings=args.max_seq_len,
        ).save_pretrained(path)

    def build() -> tuple[object, Path | None]:
        hf = load_model(name)
        return hf.model, hf.weights

    return build


def one_step(
    model: Model, k: int, schedule: str, opts: argparse.Namespace, path: str
) -> dict[str, float]:
    """The NVMe bytes and wall time of one step of `k` micro-batches (after a warm-up step)."""
    cfg = Config(
        placement=NVME,
        nvme_path=[path],
        dtype="fp32",
        lr=1e-4,
        total_steps=4,
        accumulate=k,
        schedule=schedule,
        host_budget=opts.host_budget,
        prefetch_depth=opts.prefetch_depth,
    )
    data = TokenBatches(default_corpus(4 << 20), opts.batch_size, opts.seq_len, seed=0)
    module, weights = model()
    n = sum(p.numel() for p in module.parameters())
    with Engine(module, cfg, weights=weights) as engine:
        for _ in range(k):  # warm-up step
            engine.train_micro_batch(data.next_batch())
        engine.stats()
        store = engine.vertical.store
        before = store.spilled if store is not None else 0
        t0 = time.perf_counter()
        losses = [engine.train_micro_batch(data.next_batch()) for _ in range(k)]
        _ = [t.item() for t in losses]  # the step has run
        seconds = time.perf_counter() - t0
        stats = engine.stats()
        # activations spilled in this step
        spilled = store.spilled - before if store is not None else 0
    return {
        "read": stats.get("bytes_nvme->host", 0) / n,
        "written": stats.get("bytes_host->nvme", 0) / n,
        "cache": stats.get("bytes_host_cache_hit", 0) / n,
        "seconds": seconds,
        "spilled": spilled,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="a small shape (4 layers, dim 256, vocab 4096)"
    )
    p.add_argument(
        "--model", default=None, help="hf:DIR, a Hugging Face decoder (default: the built-in model)"
    )
    p.add_argument(
        "--accumulate",
        default=",".join(map(str, ACCUMULATIONS)),
        help="the k to measure, comma-separated",
    )
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument(
        "--host-budget",
        default="512MiB",
        help="small enough that the host cache cannot hold the params",
    )
    p.add_argument(
        "--prefetch-depth",
        type=int,
        default=None,
        help="default: the engine's choice for the budget",
    )
    p.add_argument(
        "--nvme-path",
        default=None,
        help="a directory on the drive to measure (default: a temp dir)",
    )
    opts = p.parse_args()
    if opts.model is not None and not is_hf(opts.model):
        p.error("--model takes hf:DIR")
    return opts


def main() -> None:
    opts = parse_args()
    args, opts.host_budget = nvme_shape(opts.quick, opts.host_budget)
    accumulations = tuple(int(k) for k in opts.accumulate.split(","))
    model = (
        hf_model(opts.model, args)
        if opts.model
        else lambda: (models.build(args, device="meta"), None)
    )
    module, _ = model()
    params = sum(p.numel() for p in module.parameters())
    console = Console()
    console.print(
        f"{opts.model or 'built-in'}: {params / 1e6:.1f}M params, "
        f"fp32, everything on NVMe, micro-batch {opts.batch_size} x {opts.seq_len}, "
        f"host budget {opts.host_budget}",
        markup=False,
    )
    rows: dict[tuple[str, int], dict[str, float]] = {}
    for schedule in ("horizontal", "vertical"):
        for k in accumulations:
            with tempfile.TemporaryDirectory(dir=opts.nvme_path) as path:
                rows[schedule, k] = one_step(model, k, schedule, opts, path)
            console.print(f"  {schedule} k={k}: {rows[schedule, k]}")
    print_table(console, rows, accumulations)


def print_table(
    console: Console, rows: dict[tuple[str, int], dict[str, float]], accumulations: tuple[int, ...]
) -> None:
    """NVMe bytes per parameter and step time per k and schedule, then how each schedule's
    bytes grow from the first k to the last."""
    table = Table(title="NVMe bytes per parameter per step, and step time")
    for column in (
        "k",
        "horizontal B/param",
        "vertical B/param",
        "horizontal s",
        "vertical s",
        "spilled acts",
    ):
        table.add_column(column, justify="right")
    for k in accumulations:
        h, v = rows["horizontal", k], rows["vertical", k]
        table.add_row(
            str(k),
            f"{h['read'] + h['written']:.1f} (+{h['cache']:.1f} cached)",
            f"{v['read'] + v['written']:.1f} (+{v['cache']:.1f} cached)",
            f"{h['seconds']:.1f}",
            f"{v['seconds']:.1f}",
            str(int(v["spilled"])),
        )
    console.print(table)
    total = {
        s: {k: rows[s, k]["read"] + rows[s, k]["written"] for k in accumulations}
        for s in ("horizontal", "vertical")
    }
    first, last = accumulations[0], accumulations[-1]
    vertical = total["vertical"][last] / total["vertical"][first]
    horizontal = total["horizontal"][last] / total["horizontal"][first]
    console.print(f"vertical k={last} / k={first}: {vertical:.3f}x; horizontal: {horizontal:.2f}x")


if __name__ == "__main__":
    main()
