"""`DiskBench`: how fast a directory's drive moves bytes, raw, through `NvmeStore`, and with fio.

The measurements are a plan -- a list of `Step`s the caller runs in order (the CLI draws a
progress bar over them). These disks vary 2x from one second to the next, so the store is only
ever compared with measurements taken right beside it: each round runs raw, store and fio
back to back, for writes and then for reads, and a ratio is the median over rounds of that
round's ratio. Throughputs are the best of their rounds. GB/s are 1e9 bytes per second.

- raw: `os.pwrite` / `os.preadv` with O_DIRECT from aligned buffers, `RAW_BLOCK_BYTES` blocks,
  on the I/O loop's threads (the same pool the store uses): the ceiling for Python
  (`planning.rawio`).
- store: `NvmeStore` writing and reading `shard_bytes` shards of one buffer, all in flight at
  once; the default chunk size in every round, a few other chunk sizes once.
- fio (optional), direct I/O (`planning.fio`: the sweep, command lines, and its wall-span
  figure). The sweep first picks the best configuration for each direction (its best figure is
  reported); the rounds then run that one. fio's own figure is reported beside ours. Without
  O_DIRECT, fio's file is fsynced after it exits and that time is added to a write's span, as
  the store's writes are timed up to their fsync.

Data: every path writes incompressible bytes that no block-level dedupe can match, because a
virtual disk may compress or dedupe (an earlier version wrote a constant 0x5A from raw and the
store while fio wrote random data, which flattered the store). The buffer is filled once with
random bytes (every sector distinct within a write), and before each write, untimed, the first
8 bytes of every 512 B sector are redrawn (tens of ms for 1 GiB, where refilling it all takes
seconds), so no sector repeats one written before, on any path. fio runs with
`--refill_buffers` (fresh random bytes for every request) and `--randrepeat=0`. Its default
(scramble_buffers: offset and time stamped into every 512 B) left 1 MiB samples 3-7%
compressible by zlib here, and `--buffer_compress_percentage=0` turned scrambling off so every
block of a job was identical -- so neither is used. refill costs fio CPU (about half a core at
1.8 GB/s here) that the store does not spend; the multi-job configurations spread it.

Within a round the three take turns going first (drives with burst credits favour whoever
writes after a pause). Like fio, which lays its files out before timing them, every target is
written untimed first (a store twice, which also fills its spare files): timed writes
overwrite, as every training step overwrites its shards, and stores stay open across rounds as
in a training run.

Reads are cold and never of data just written: every path has two slots (raw and fio: two
files; the store: two sets of keys); round r writes slot r % 2 and reads the other slot, last
written a round earlier (the first round and the first sweep configuration read the layout),
with about five times `nbytes` of other I/O in between. O_DIRECT bypasses the guest's page
cache; without it, files are fsynced and dropped from the cache (POSIX_FADV_DONTNEED; fio:
`--invalidate=1`) before reading, and buffered writes are timed up to their fsync. A
hypervisor's cache below a virtual disk is out of any guest's reach (`drop_caches` included,
which is also machine-wide, so it is not used); the slots only keep it from serving what was
just written. Direct writes are timed without the final fsync, as fio times them. Everything
is written under a fresh temp directory inside `directory`, removed by `close()`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tierzero.planning.fio import (
    FioConfig,
    check_fio,
    config_name,
    fio_command,
    fio_engines,
    fio_sweep,
    fio_wall_span,
    run_fio,
)
from tierzero.planning.rawio import RAW_BLOCK_BYTES, drop_cache, time_raw
from tierzero.storage.base import StorageError
from tierzero.storage.durable import fsync_path
from tierzero.storage.host import HostPool
from tierzero.storage.io import IOLoop
from tierzero.storage.nvme import chunkfile
from tierzero.storage.nvme.store import NvmeStore

DEFAULT_CHUNK_BYTES = 8 << 20
OTHER_CHUNK_BYTES = (1 << 20, 4 << 20, 32 << 20)
MAX_SHARD_BYTES = 128 << 20
SLOTS = 2  # write one, read the other (written a round earlier)
STAMP_BYTES = 512  # the smallest logical block (sector) a disk or a dedupe layer can key on
DATA_SEED = 0x7132  # fixed, so a run's bytes are reproducible; the stamps make writes differ
_MiB = 1 << 20
# peak disk use in multiples of the size: raw and fio two slots each, one store at a time with
# two slots, each with its spare files
FOOTPRINT = 8


@dataclass(frozen=True)
class Step:
    """One measurement of the plan: a label for the progress bar and the call that runs it.

    Steps of one `group` run all or none of them. Group 0 (layout, fio sweep, round 1, and any
    step a caller adds without a group) always runs; a runner with a time limit skips the later
    groups (further rounds, other chunk sizes) that would start after the limit, which keeps
    the bench bounded in time on a slow drive.
    """

    label: str
    run: Callable[[], None]
    group: int = 0


@dataclass
class DiskBench:
    """Measures `nbytes` of writes and cold reads in `directory`; see the module docstring."""

    directory: str
    nbytes: int
    io_loop: IOLoop
    pool: HostPool
    rounds: int = 5
    fio: bool = False
    _work: str = ""
    _direct: bool = False
    _buf: torch.Tensor | None = None
    _bits: np.random.PCG64 | None = None
    _fio_engines: frozenset[str] = frozenset()
    _fio_skipped: dict[str, str] = field(default_factory=dict)  # engine -> why
    _samples: dict[str, list[float]] = field(default_factory=dict)  # GB/s, in run order
    # per direction and config: (wall-span GB/s, fio's own GB/s)
    _fio_sweep: dict[str, dict[FioConfig, tuple[float, float]]] = field(default_factory=dict)
    _stores: dict[int, NvmeStore] = field(default_factory=dict)  # by chunk_bytes

    def __post_init__(self) -> None:
        if self.nbytes < _MiB:
            raise StorageError(f"bench size {self.nbytes} bytes is too small: use at least 1 MiB")
        self.nbytes -= self.nbytes % _MiB
        if self.rounds < 1:
            raise StorageError(f"bench rounds must be at least 1, got {self.rounds}")

    @property
    def shard_bytes(self) -> int:
        return min(MAX_SHARD_BYTES, max(_MiB, self.nbytes // 8 // _MiB * _MiB))

    def open(self) -> None:
        """Check the directory and its free space, find fio and its engines, lease the buffer
        and fill it with random bytes."""
        if not os.path.isdir(self.directory):
            raise StorageError(
                f"bench directory {self.directory} does not exist; create it or pass another --path"
            )
        need = FOOTPRINT * self.nbytes
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise StorageError(
                f"bench needs {need} free bytes in {self.directory} "
                f"({FOOTPRINT}x --size), only {free} are free: pass a smaller "
                f"--size"
            )
        if self.fio:
            check_fio()
        self._work = tempfile.mkdtemp(prefix=".tierzero-bench-", dir=self.directory)
        self._direct = chunkfile.probe_direct(self._work)
        if self.fio:
            self._fio_engines, self._fio_skipped = fio_engines(self._work, self._direct)
        self._buf = self.pool.lease(self.nbytes)
        # Random once (this also faults every page in now, not inside a timed run): filling
        # 1 GiB takes seconds, so each write only redraws the sector stamps (`_stamp`).
        self._bits = np.random.PCG64(DATA_SEED)
        words = self._buf.numpy().view(np.uint64)
        step = _MiB  # words per refill call: bounds the temporary to 8 MiB
        for off in range(0, len(words), step):
            words[off : off + step] = self._bits.random_raw(len(words[off : off + step]))

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
        self._stores.clear()
        if self._buf is not None:
            self.pool.give_back(self._buf)
            self._buf = None
        if self._work:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = ""

    def __enter__(self) -> DiskBench:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the plan -------------------------------------------------------------------------

    def steps(self) -> list[Step]:
        """Every measurement, in the order it must run."""
        default = DEFAULT_CHUNK_BYTES
        plan = [
            Step(f"raw layout, slot {s}", lambda s=s: self._raw("write", s, record=False))
            for s in range(SLOTS)
        ]
        plan += self._store_layout(default)
        if self.fio:
            layout = ("libaio", min(RAW_BLOCK_BYTES, self.nbytes), 8, 1)
            plan += [
                Step(
                    f"fio layout, slot {s}", lambda s=s: self._fio("write", layout, s, record=None)
                )
                for s in range(SLOTS)
            ]
            # each configuration writes one slot, then reads the one its predecessor wrote
            for k, c in enumerate(self.fio_configs()):
                plan += [
                    Step(
                        f"fio sweep: write {config_name(*c)}",
                        lambda c=c, k=k: self._fio("write", c, k % SLOTS, record="sweep"),
                    ),
                    Step(
                        f"fio sweep: read {config_name(*c)}",
                        lambda c=c, k=k: self._fio("read", c, (k + 1) % SLOTS, record="sweep"),
                    ),
                ]
        for r in range(1, self.rounds + 1):
            group = 0 if r == 1 else r
            for rw, slot in (("write", r % SLOTS), ("read", (r + 1) % SLOTS)):
                turn = [
                    Step(f"raw {rw} (round {r})", lambda rw=rw, s=slot: self._raw(rw, s), group),
                    Step(
                        f"store {rw} (round {r})",
                        lambda rw=rw, s=slot: self._store(rw, default, s),
                        group,
                    ),
                ]
                if self.fio:
                    turn.append(
                        Step(
                            f"fio {rw} (round {r})",
                            lambda rw=rw, s=slot: self._fio_best(rw, s),
                            group,
                        )
                    )
                first = (r - 1) % len(turn)
                plan += turn[first:] + turn[:first]
        for i, c in enumerate(OTHER_CHUNK_BYTES):
            mib, group = c // _MiB, self.rounds + 1 + i
            if i == 0:  # one store on disk at a time keeps the footprint at FOOTPRINT x size
                plan.append(
                    Step(
                        f"store cleanup, {default // _MiB} MiB chunks",
                        lambda: self._drop_store(default),
                        group,
                    )
                )
            plan += [
                *self._store_layout(c, group),
                Step(
                    f"store write, {mib} MiB chunks", lambda c=c: self._store("write", c, 1), group
                ),
                Step(f"store read, {mib} MiB chunks", lambda c=c: self._store("read", c, 0), group),
                Step(f"store cleanup, {mib} MiB chunks", lambda c=c: self._drop_store(c), group),
            ]
        return plan

    def fio_configs(self) -> list[FioConfig]:
        """The sweep for this fio and size: each job moves at least one block."""
        return [c for c in fio_sweep(self._fio_engines) if self.nbytes // c[3] >= c[1]]

    def _store_layout(self, chunk_bytes: int, group: int = 0) -> list[Step]:
        label = f"store layout, {chunk_bytes // _MiB} MiB chunks"
        return [
            Step(
                f"{label}, slot {s}",
                lambda s=s: self._store("write", chunk_bytes, s, record=False),
                group,
            )
            for s in range(SLOTS)
            for _ in range(2)
        ]  # twice: fills the spare files

    def result(self) -> dict[str, Any]:
        """The `nvme`, `fio`, `ratios` and `per_round` (every round's GB/s, in run order) sections
        of the bench report (fio: None unless run)."""
        default = DEFAULT_CHUNK_BYTES
        nvme = {
            "read_gbps": self._best(f"store.{default}.read"),
            "write_gbps": self._best(f"store.{default}.write"),
            "raw_read_gbps": self._best("raw.read"),
            "raw_write_gbps": self._best("raw.write"),
            "chunk_bytes": default,
            "shard_bytes": self.shard_bytes,
            "bytes": self.nbytes,
            "rounds": len(self._samples.get(f"store.{default}.write", [])),
            "rounds_planned": self.rounds,
            "direct_io": self._direct,
            "data": "random, sector stamps redrawn per write",
            "chunk_sweep": [
                {
                    "chunk_bytes": c,
                    "read_gbps": self._best(f"store.{c}.read"),
                    "write_gbps": self._best(f"store.{c}.write"),
                }
                for c in sorted((*OTHER_CHUNK_BYTES, default))
            ],
        }
        fio = None
        if self.fio:
            fio = {}
            for rw in ("read", "write"):
                config = self._fio_best_config(rw)
                gbps, reported = self._fio_sweep[rw][config]
                fio[f"{rw}_gbps"] = round(max(gbps, *self._samples[f"fio.{rw}"]), 3)
                fio[f"{rw}_gbps_fio_reported"] = round(
                    max(reported, *self._samples[f"fio_reported.{rw}"]), 3
                )
                fio[f"{rw}_config"] = config_name(*config)
            fio["sweep"] = [
                {
                    "config": config_name(*c),
                    **{
                        f"{rw}_gbps": round(self._fio_sweep[rw][c][0], 3)
                        for rw in ("write", "read")
                    },
                }
                for c in self.fio_configs()
            ]
            fio["engines_skipped"] = dict(self._fio_skipped)
        ratios = {
            f"{rw}_vs_{base}": self._paired_ratio(f"store.{default}.{rw}", f"{base}.{rw}")
            for base in ("raw", "fio")
            for rw in ("read", "write")
        }
        per_round = {
            f"{name}_{rw}_gbps": [round(x, 3) for x in self._samples[f"{source}.{rw}"]]
            for name, source in (
                ("store", f"store.{default}"),
                ("raw", "raw"),
                ("fio", "fio"),
                ("fio_reported", "fio_reported"),
            )
            for rw in ("write", "read")
            if f"{source}.{rw}" in self._samples
        }
        return {"nvme": nvme, "fio": fio, "ratios": ratios, "per_round": per_round}

    def _best(self, name: str) -> float | None:
        """The best sample of `name`, or None when it was skipped."""
        samples = self._samples.get(name)
        return round(max(samples), 3) if samples else None

    def _paired_ratio(self, name: str, base: str) -> float | None:
        """Median over rounds of this round's `name` / `base`: noise common to both cancels."""
        pairs = list(zip(self._samples.get(name, []), self._samples.get(base, [])))
        return round(statistics.median(a / b for a, b in pairs), 3) if pairs else None

    # -- measurements ---------------------------------------------------------------------

    def _record(self, name: str, gbps: float) -> None:
        self._samples.setdefault(name, []).append(gbps)

    def _stamp(self) -> None:
        """Redraw the first 8 bytes of every 512 B sector, so no sector of this write repeats one
        written before on any path (the rest of each sector keeps the random fill)."""
        assert self._buf is not None and self._bits is not None
        stamps = self._buf.numpy().view(np.uint64)[:: STAMP_BYTES // 8]
        stamps[:] = self._bits.random_raw(len(stamps))

    def _raw(self, rw: str, slot: int, record: bool = True) -> None:
        assert self._buf is not None
        if rw == "write":
            self._stamp()
        path = os.path.join(self._work, f"raw.{slot}.bin")
        seconds = time_raw(
            self.io_loop, memoryview(self._buf.numpy()), self.nbytes, path, rw, self._direct
        )
        if record:
            self._record(f"raw.{rw}", self.nbytes / seconds / 1e9)

    def _store(self, rw: str, chunk_bytes: int, slot: int, record: bool = True) -> None:
        assert self._buf is not None
        store = self._stores.get(chunk_bytes)
        if store is None:
            root = os.path.join(self._work, f"store-{chunk_bytes}")
            os.makedirs(root)
            store = self._stores[chunk_bytes] = NvmeStore(
                [root], chunk_bytes=chunk_bytes, direct=self._direct
            )
            store.open()
        shards = {
            f"bench/{slot}/s{i:04d}/r0": self._buf[off : off + self.shard_bytes]
            for i, off in enumerate(range(0, self.nbytes, self.shard_bytes))
        }
        if rw == "write":
            self._stamp()
        elif not self._direct:
            for dirpath, _, names in os.walk(store.paths[0]):
                for name in names:
                    drop_cache(os.path.join(dirpath, name))

        async def run() -> None:
            if rw == "write":
                await asyncio.gather(*(store.write(k, v) for k, v in shards.items()))
                if not self._direct:
                    await store.flush()
            else:
                await asyncio.gather(*(store.read_into(k, v) for k, v in shards.items()))

        start = time.perf_counter()
        self.io_loop.run(run())
        seconds = time.perf_counter() - start
        if rw == "write":
            self.io_loop.run(store.flush())
        if record:
            self._record(f"store.{chunk_bytes}.{rw}", self.nbytes / seconds / 1e9)

    def _drop_store(self, chunk_bytes: int) -> None:
        """Close and remove a chunk size's store, keeping the disk footprint at a few x size."""
        store = self._stores.pop(chunk_bytes)
        store.close()
        shutil.rmtree(store.paths[0])

    def _fio(self, rw: str, config: FioConfig, slot: int, record: str | None = "round") -> None:
        """One fio run on slot file `slot`; `record`: "round", "sweep" or None (layout)."""
        path = os.path.join(self._work, f"fio.{slot}.bin")
        log_dir = os.path.join(self._work, "fio-logs")
        os.makedirs(log_dir, exist_ok=True)
        cmd = fio_command(rw, config, path, self.nbytes, self._direct, os.path.join(log_dir, "job"))
        try:
            report = run_fio(cmd, path)
            reported = report["jobs"][0][rw]["bw_bytes"] / 1e9
            seconds, nbytes = fio_wall_span(log_dir)
            if rw == "write" and not self._direct:
                start = time.perf_counter()
                fsync_path(path)
                seconds += time.perf_counter() - start
            gbps = nbytes / seconds / 1e9
        finally:
            shutil.rmtree(log_dir, ignore_errors=True)
        if record == "sweep":
            self._fio_sweep.setdefault(rw, {})[config] = (gbps, reported)
        elif record == "round":
            self._record(f"fio.{rw}", gbps)
            self._record(f"fio_reported.{rw}", reported)

    def _fio_best_config(self, rw: str) -> FioConfig:
        """The sweep's configuration with the best wall-span figure for `rw`."""
        return max(self._fio_sweep[rw], key=lambda config: self._fio_sweep[rw][config][0])

    def _fio_best(self, rw: str, slot: int) -> None:
        """Run the sweep's best configuration for `rw` again, beside the store."""
        self._fio(rw, self._fio_best_config(rw), slot)
