"""What a checkpoint costs: time and bytes written for 1x and 10x the training state, side by side.

A checkpoint of NVMe-homed state hard-links the store's current chunk files (see
`tierzero.engine.checkpointing`), so its cost should be metadata -- about constant in the state's
size -- and zero bytes copied while the run directory is on the NVMe path's filesystem. This script
measures that claim instead of asserting it (the test suite counts `bytes_copied`; it times
nothing).

Variants, each its own `Engine` with everything on NVMe (fp32, one rank, built on `meta`):

- `1x`: a ~20M-param model (6 blocks, dim 512); run dir on the NVMe path's filesystem;
- `10x`: a ~200M-param model (16 blocks, dim 1024); same filesystem;
- `1x, other fs`: the 1x model with its run dir on /dev/shm (tmpfs), so links cannot cross
  and every chunk is copied: the path `bytes_copied` and the engine's note are about.

Rounds are interleaved (each round trains every variant one step, so the store has changed,
then saves it; the variant order rotates per round). Per save it records:

- save time: the whole `engine.save_checkpoint(run_dir)` call -- drain, `syncfs` of the NVMe
  store, one hard link (or copy) per chunk, `syncfs` of the run dir, manifest, rename;
- written (this process): `/proc/self/io` write_bytes -- bytes this process caused to be sent
  to a block device, O_DIRECT included; tmpfs counts nothing here;
- write syscalls: `/proc/self/io` wchar -- bytes passed to write(2)/sendfile(2), any filesystem;
- disk sectors: the delta of sectors written in `/sys/dev/block/<dev>/stat` of the NVMe path's
  disk, x 512 -- what actually reached the disk (journal and metadata included), but from
  every process on the machine, so other jobs show up in it;
- the manifest's `bytes_copied` and how many chunk files of the checkpoint share their inode
  with the live store right after the save (`st_nlink > 1`);
- where the save's time went: waiting for the step's last transfers (`pending.drain()`, which
  a save must do and the next step would otherwise do), inside `syncfs` (the store's flush and
  the run dir's), and the rest (links or copies, manifest, rename). The two are measured by
  wrapping those two functions for the duration of the call; nothing else is changed.

`--flush-first` syncs the NVMe filesystem after each step, outside the timed save (its time is
reported on its own): the save's own `syncfs` then finds little to flush, which separates what
the checkpoint costs from making the step's writes durable, which any checkpoint has to pay.

Resume is then timed once per variant in a fresh engine: `Engine.load_checkpoint(run_dir)`
verifies every chunk's crc32c (reads all saved state once), then adopts the chunks by links.
The checkpoint's files are first dropped from the page cache (`posix_fadvise(DONTNEED)` on those
files only), so the read is cold; its `read_bytes` are reported.

    python benchmarks/checkpoint_cost.py                       # defaults as in the README
    python benchmarks/checkpoint_cost.py --rounds 3 --path /mnt/ssd0/tz-bench

It needs about 96 bytes per parameter (23 GB) free under --path and 1.5 GB under /dev/shm,
and removes everything it wrote.
Never run in CI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tierzero.storage.nvme import chunkfile

from tierzero import Config, Engine, models
from tierzero.bench.procfs import proc_io
from tierzero.checkpoint.catalog import prune
from tierzero.checkpoint.manifest import Manifest
from tierzero.models import ModelArgs
from tierzero.run.data import TokenBatches, default_corpus

SHAPES = {
    "1x": ModelArgs(
        dim=512,
        n_layers=6,
        n_heads=8,
        n_kv_heads=8,
        vocab_size=256,
        ffn_dim=1408,
        max_seq_len=64,
        tie_embeddings=True,
    ),
    "10x": ModelArgs(
        dim=1024,
        n_layers=16,
        n_heads=16,
        n_kv_heads=16,
        vocab_size=256,
        ffn_dim=2752,
        max_seq_len=64,
        tie_embeddings=True,
    ),
}
# live store 20 (param, grad, master, exp_avg, exp_avg_sq) + up to as much in spare files + 3 x 16
# in checkpoints (two kept, and the new one before pruning) + a little for chunk padding
DISK_BYTES_PER_PARAM = 96
# the 1x model's shards end in partly filled 8 MiB chunks: its checkpoints take ~1.5x its state
OTHER_FS_BYTES_PER_PARAM = 3 * 16 * 3 // 2


@dataclass
class Variant:
    name: str
    args: ModelArgs
    nvme_dir: Path
    run_dir: Path
    engine: Engine | None = None
    data: TokenBatches | None = None
    state_nbytes: int = 0
    saves: list[dict] = field(default_factory=list)
    resume: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def config(self) -> Config:
        return Config(
            offload="nvme",
            nvme_path=[str(self.nvme_dir)],
            dtype="fp32",
            device="cpu",
            host_budget="1GiB",
            gpu_budget="1GiB",
            lr=1e-4,
            total_steps=100,
        )


def disk_stat_path(path: Path) -> str | None:
    """`/sys/dev/block/M:m/stat` of the block device holding `path`, if it has one."""
    dev = os.stat(path).st_dev
    stat = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
    return stat if os.major(dev) != 0 and os.access(stat, os.R_OK) else None


def sectors_written(stat: str | None) -> int | None:
    if stat is None:
        return None
    with open(stat) as f:
        # field 7: sectors written (512 B each, whatever the disk's)
        return int(f.read().split()[6])


class Counters:
    """Deltas of this process's I/O counters and the disk's written sectors over a block."""

    def __init__(self, stat: str | None) -> None:
        self.stat = stat

    def __enter__(self) -> Counters:
        self.io0, self.sec0, self.t0 = proc_io(), sectors_written(self.stat), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        io1, sec1 = proc_io(), sectors_written(self.stat)
        self.write_bytes = io1["write_bytes"] - self.io0["write_bytes"]
        self.wchar = io1["wchar"] - self.io0["wchar"]
        self.read_bytes = io1["read_bytes"] - self.io0["read_bytes"]
        self.disk_bytes = None if sec1 is None else (sec1 - self.sec0) * 512


class Phases:
    """Seconds spent in the engine's `pending.drain()` and in `chunkfile.sync_filesystem` while
    the block runs (both wrapped, then restored)."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.drain_s, self.syncfs_s = engine, 0.0, 0.0

    def _timed(self, fn, attr: str):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                setattr(self, attr, getattr(self, attr) + time.perf_counter() - t0)

        return wrapper

    def __enter__(self) -> Phases:
        self._pending = self.engine.parts.tiers.pending
        self._pending.drain = self._timed(self._pending.drain, "drain_s")  # instance attribute
        self._sync = chunkfile.sync_filesystem
        chunkfile.sync_filesystem = self._timed(self._sync, "syncfs_s")
        return self

    def __exit__(self, *exc: object) -> None:
        chunkfile.sync_filesystem = self._sync
        del self._pending.drain


def chunk_files(checkpoint: Path) -> list[Path]:
    return [p for p in (checkpoint / "state").rglob("*") if p.is_file() and p.parent.name == "c"]


def drop_from_page_cache(checkpoint: Path) -> None:
    """Evict this checkpoint's files (only them) from the page cache, so a read is cold."""
    for p in checkpoint.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def save_once(v: Variant, stat: str | None, flush_first: bool) -> None:
    t0 = time.perf_counter()
    v.engine.train_step(v.data.next_batch())  # the store changes between saves
    step_s = time.perf_counter() - t0
    flush_s = None
    if flush_first:
        t0 = time.perf_counter()
        chunkfile.sync_filesystem(str(v.nvme_dir))
        flush_s = time.perf_counter() - t0
    with Counters(stat) as c, Phases(v.engine) as phases:
        path = v.engine.save_checkpoint(v.run_dir, data=v.data.state_dict())
    manifest = Manifest.load(path)
    files = chunk_files(path)
    v.state_nbytes = manifest.nbytes
    v.saves.append(
        {
            "seconds": c.seconds,
            "write_bytes": c.write_bytes,
            "wchar": c.wchar,
            "disk_bytes": c.disk_bytes,
            "bytes_copied": manifest.origin.bytes_copied,
            "files": len(files),
            "linked": sum(os.stat(p).st_nlink > 1 for p in files),
            "step_s": step_s,
            "drain_s": phases.drain_s,
            "syncfs_s": phases.syncfs_s,
            "flush_s": flush_s,
        }
    )
    prune(v.run_dir, 2, path)  # outside the timed save: bounds disk use


def resume_once(v: Variant, stat: str | None) -> None:
    checkpoint = max((v.run_dir / "checkpoints").iterdir())
    drop_from_page_cache(checkpoint)
    engine = Engine(models.build(v.args, device="meta"), v.config())
    try:
        with Counters(stat) as c:
            manifest = engine.load_checkpoint(v.run_dir)
        v.resume = {"seconds": c.seconds, "read_bytes": c.read_bytes, "step": manifest.step}
        v.notes += [n for n in engine.notes() if n not in v.notes]
    finally:
        engine.close()


def mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:,.1f} MB"


def check_space(where: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(where).free
    if free < need:
        sys.exit(
            f"{where} has {free / 1e9:.1f} GB free but {what} needs about {need / 1e9:.1f} GB; "
            "free space or pass another --path"
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved saves per variant")
    p.add_argument(
        "--path", default=None, help="directory on the NVMe filesystem (default: a temp dir)"
    )
    p.add_argument(
        "--flush-first",
        action="store_true",
        help="syncfs after each step, outside the timed save (timed on its own)",
    )
    p.add_argument(
        "--other-fs", default="/dev/shm", help="a directory on another filesystem ('' to skip)"
    )
    return p.parse_args()


def make_variants(root: Path, other: Path | None) -> list[Variant]:
    """Every shape with its store and run dir under `root`, and the 1x one again with its run
    dir on the `other` filesystem; refused where the space they need is not free."""
    need = DISK_BYTES_PER_PARAM * sum(s.param_count() for s in SHAPES.values())
    check_space(root, need, "the benchmark")
    variants = [
        Variant(name, args, root / f"nvme-{name}", root / f"run-{name}")
        for name, args in SHAPES.items()
    ]
    if other is not None:
        small = SHAPES["1x"]
        need = OTHER_FS_BYTES_PER_PARAM * small.param_count()
        check_space(other, need, "the other-filesystem run dir")
        variants.append(Variant("1x, other fs", small, root / "nvme-1x-other", other / "run"))
    for v in variants:
        v.nvme_dir.mkdir()
    return variants


def save_rounds(
    variants: list[Variant], rounds: int, stat: str | None, flush_first: bool, console: Console
) -> None:
    """Materialise every variant, then `rounds` rounds of one step and one save each, the
    variants' order rotating per round; every engine is closed at the end."""
    with ExitStack() as stack:
        for v in variants:
            t0 = time.perf_counter()
            v.engine = stack.enter_context(Engine(models.build(v.args, device="meta"), v.config()))
            v.data = TokenBatches(default_corpus(1 << 20), batch_size=1, seq_len=32, seed=0)
            console.print(
                f"{v.name}: {v.args.param_count() / 1e6:.1f}M params, materialised on NVMe "
                f"in {time.perf_counter() - t0:.1f}s"
            )
        for r in range(rounds):
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                save_once(v, stat, flush_first)
                s = v.saves[-1]
                flushed = f"; flushed first in {s['flush_s']:.3f}s" if flush_first else ""
                console.print(
                    f"round {r + 1} {v.name}: step {s['step_s']:.1f}s, save {s['seconds']:.3f}s "
                    f"(drain {s['drain_s']:.3f}s, syncfs {s['syncfs_s']:.3f}s{flushed}), "
                    f"written {mb(s['write_bytes'])}, disk {mb(s['disk_bytes'])}, "
                    f"copied {mb(s['bytes_copied'])}"
                )
        for v in variants:
            v.notes += v.engine.notes()


def median_mb(saves: list[dict], key: str) -> str:
    values = [s[key] for s in saves]
    return "n/a" if None in values else mb(int(statistics.median(values)))


def median_s(saves: list[dict], key: str) -> str:
    return f"{statistics.median(s[key] for s in saves):.3f} s"


def print_table(console: Console, variants: list[Variant], rounds: int, flush_first: bool) -> None:
    """One row per variant: medians of its saves, its resume, then every save's time."""
    title = f"checkpoint cost, {rounds} interleaved saves per variant (median / min)"
    table = Table(title=title + (", each after a separate syncfs" if flush_first else ""))
    for col in (
        "variant",
        "params",
        "state saved",
        *(["syncfs before (not in save)"] if flush_first else []),
        "save time",
        "of which drain",
        "of which syncfs",
        "written (this process)",
        "write syscalls",
        "disk sectors (all processes)",
        "bytes copied",
        "chunk files linked",
        "resume (cold, verified)",
        "resume read",
    ):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v in variants:
        times = [s["seconds"] for s in v.saves]
        last = v.saves[-1]
        table.add_row(
            v.name,
            f"{v.args.param_count() / 1e6:.1f}M",
            mb(v.state_nbytes),
            *([median_s(v.saves, "flush_s")] if flush_first else []),
            f"{statistics.median(times):.3f} / {min(times):.3f} s",
            median_s(v.saves, "drain_s"),
            median_s(v.saves, "syncfs_s"),
            median_mb(v.saves, "write_bytes"),
            median_mb(v.saves, "wchar"),
            median_mb(v.saves, "disk_bytes"),
            median_mb(v.saves, "bytes_copied"),
            f"{last['linked']} / {last['files']}",
            f"{v.resume['seconds']:.2f} s",
            mb(v.resume["read_bytes"]),
        )
    console.print(table)
    for v in variants:
        console.print(
            f"{v.name} saves (drain, syncfs): "
            + ", ".join(
                f"{s['seconds']:.3f}s ({s['drain_s']:.3f}, {s['syncfs_s']:.3f})" for s in v.saves
            )
        )
        for note in v.notes:
            console.print(f"[yellow]note ({v.name}):[/] {note}", highlight=False)


def main() -> None:
    a = parse_args()
    console = Console(width=200)
    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="tierzero-ckpt-cost-", dir=a.path))
    other = (
        Path(tempfile.mkdtemp(prefix="tierzero-ckpt-cost-", dir=a.other_fs)) if a.other_fs else None
    )
    try:
        variants = make_variants(root, other)
        stat = disk_stat_path(root)
        console.print(
            f"NVMe path {root} ({stat or 'no block device stats'}); "
            f"other filesystem: {other or 'skipped'}; torch threads {torch.get_num_threads()}"
        )
        save_rounds(variants, a.rounds, stat, a.flush_first, console)
        for v in variants:  # every engine is closed: each resume opens its store again
            resume_once(v, stat)
            console.print(
                f"resume {v.name}: {v.resume['seconds']:.2f}s, read {mb(v.resume['read_bytes'])}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if other is not None:
            shutil.rmtree(other, ignore_errors=True)
    print_table(console, variants, a.rounds, a.flush_first)


if __name__ == "__main__":
    main()
