"""The host floor: a 134M model (LLaMA shape, hidden 768, 12 layers, vocab 32000, untied) trained
with every state kind on NVMe at a small host budget, in fp32 and in bf16.

Before units and pieces, this model needed a 2.95 GB host budget: its root unit (embedding +
head, 49M params) was held for the whole step with its grad and optimizer states stepped in one
piece. Now the embedding and the head are units of their own and optimizer state streams in
pieces, so the floor is a few pieces plus the compute copies of the units in flight.

Prints, per dtype: the host budget, the pools' peaks, the process's peak RSS (VmHWM), NVMe bytes
per parameter per step (read / written; the host cache is left at its default, so re-fetches
it serves are not counted), step time and loss. Never run in CI; needs ~3 GB of disk.

    python benchmarks/host_floor.py --path /work/scratch --host-budget 512MiB
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from tierzero import Config, Engine, models
from tierzero.models import ModelArgs
from tierzero.run.data import TokenBatches, default_corpus

SHAPE = ModelArgs(
    dim=768,
    n_layers=12,
    n_heads=12,
    n_kv_heads=12,
    vocab_size=32000,
    ffn_dim=2048,
    max_seq_len=256,
    tie_embeddings=False,
)


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_hwm() -> None:
    """Start VmHWM again from the current RSS (Linux: write 5 to clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def run(path: str, dtype: str, budget: str, steps: int, piece_numel: int) -> dict:
    reset_hwm()
    cfg = Config(
        offload="nvme",
        nvme_path=[path],
        host_budget=budget,
        dtype=dtype,
        lr=1e-4,
        lr_schedule="constant",
        piece_numel=piece_numel,
        prefetch_depth=1,
    )
    data = TokenBatches(default_corpus(), 2, 128, seed=0)
    params = SHAPE.param_count()
    rows = []
    with Engine(models.build(SHAPE, device="meta"), cfg) as engine:
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = engine.train_step(data.next_batch())
            seconds = time.perf_counter() - t0
            stats = engine.stats()
            rows.append(
                {
                    "loss": loss,
                    "seconds": seconds,
                    "read": stats.get("bytes_nvme->host", 0) / params,
                    "written": stats.get("bytes_host->nvme", 0) / params,
                    "peak_host": stats.get("peak_host_bytes", 0),
                    "peak_gpu": stats.get("peak_gpu_bytes", 0),
                }
            )
    return {"dtype": dtype, "rows": rows, "rss": vm_hwm(), "budget": cfg.tiering.host_budget}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--path", default=".", help="directory on the drive to test (a temp dir is made inside)"
    )
    p.add_argument("--host-budget", default="512MiB")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--piece-numel", type=int, default=1 << 20)
    p.add_argument("--dtype", nargs="+", default=["fp32", "bf16"])
    a = p.parse_args()
    print(
        f"{SHAPE.param_count() / 1e6:.1f}M params, host budget {a.host_budget}, "
        f"pieces of {a.piece_numel:,}"
    )
    print(
        f"{'dtype':6} {'step':>4} {'loss':>8} {'s':>6} {'nvme read B/p':>14} {'written B/p':>12} "
        f"{'total B/p':>10} {'peak host MB':>13} {'peak dev MB':>12}"
    )
    for dtype in a.dtype:
        root = tempfile.mkdtemp(prefix="tierzero-floor-", dir=a.path)
        try:
            result = run(root, dtype, a.host_budget, a.steps, a.piece_numel)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for i, r in enumerate(result["rows"], 1):
            print(
                f"{dtype:6} {i:>4} {r['loss']:>8.4f} {r['seconds']:>6.1f} {r['read']:>14.1f} "
                f"{r['written']:>12.1f} {r['read'] + r['written']:>10.1f} "
                f"{r['peak_host'] / 1e6:>13.1f} {r['peak_gpu'] / 1e6:>12.1f}"
            )
        print(f"{dtype:6} peak RSS (VmHWM since this run began) {result['rss'] / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
