"""What `verify_reads` costs: step and checkpoint time with and without crc32c on every NVMe read.

Two engines train the same small model with everything on NVMe (fp32, one rank, built on
`meta`), one with `verify_reads="on"`, one with `"off"`, each on its own store under `--dir`
(default: a temporary directory in the working directory, so on its filesystem, not /tmp's).
Rounds are interleaved -- each round times `--steps` steps of one variant, then of the other,
the order alternating per round -- so load from other processes falls on both alike. Then each
saves `--saves` checkpoints, timed: with verification on, the save checks every chunk before it
links it (`NvmeStore.freeze(verify=True)`), so this is what never linking a damaged chunk costs.

It prints the median step and save time per variant and their ratio (on / off), plus the
crc32c rate and one thread's read rate of the store that `verify_reads="auto"` compares
(`storage.nvme.chunkfile.verify_is_cheap`). Never run in CI.

    python benchmarks/verify_cost.py [--dim 512] [--layers 6] [--rounds 5] [--steps 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tierzero.storage.nvme import chunkfile

from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.models import ModelArgs
from tierzero.run.data import TokenBatches, default_corpus

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)


def engine(root: Path, args: ModelArgs, verify: str) -> Engine:
    (root / verify).mkdir()
    cfg = Config(
        placement=NVME,
        nvme_path=[str(root / verify / "nvme")],
        verify_reads=verify,
        host_budget="2GiB",
        gpu_budget="2GiB",
        total_steps=1000,
    )
    return Engine(models.build(args, device="meta"), cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None)
    a = p.parse_args()
    args = ModelArgs(
        dim=a.dim,
        n_layers=a.layers,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=4096,
        ffn_dim=a.dim * 3,
        max_seq_len=128,
    )
    data = TokenBatches(default_corpus(1 << 20), 4, 128, seed=0)
    with tempfile.TemporaryDirectory(dir=a.dir or Path.cwd(), prefix="verify-cost-") as tmp:
        root = Path(tmp)
        engines = {v: engine(root, args, v).open() for v in ("off", "on")}
        try:
            for e in engines.values():
                e.train_step(data.next_batch())  # warm up: first writes, allocations
            steps: dict[str, list[float]] = {v: [] for v in engines}
            for r in range(a.rounds):
                for v in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    start = time.perf_counter()
                    for _ in range(a.steps):
                        engines[v].train_step(data.next_batch())
                    steps[v].append((time.perf_counter() - start) / a.steps)
            saves: dict[str, list[float]] = {v: [] for v in engines}
            for r in range(a.saves):
                for v in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    # the save links freshly written chunks
                    engines[v].train_step(data.next_batch())
                    start = time.perf_counter()
                    engines[v].save_checkpoint(root / v / "run", keep=1)
                    saves[v].append(time.perf_counter() - start)
            nbytes = sum(u.shard_numel for u in engines["on"].units) * 4 * 4
        finally:
            for e in engines.values():
                e.close()
        crc = chunkfile.crc32c_rate()
        read = chunkfile.read_rate(str(root), 8 << 20, chunkfile.probe_direct(str(root)))
    print(
        f"model: dim {a.dim}, {a.layers} blocks; {nbytes / 1e6:.0f} MB of state on NVMe; "
        f"{a.rounds} interleaved rounds of {a.steps} steps, {a.saves} saves each"
    )
    print(f"{'':18}{'verify off':>12}{'verify on':>12}{'on / off':>10}")
    for what, times in (("step (s)", steps), ("save (s)", saves)):
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        print(f"{what:18}{off:12.3f}{on:12.3f}{on / off:10.3f}")
    print(
        f"crc32c {crc / 1e9:.2f} GB/s, one thread reads the store at {read / 1e9:.2f} GB/s: "
        f"{crc / read:.1f}x (auto verifies at {chunkfile.CHEAP_CRC_RATIO}x: "
        f"{'on' if crc >= chunkfile.CHEAP_CRC_RATIO * read else 'off'} here)"
    )


if __name__ == "__main__":
    main()
