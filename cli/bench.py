"""`tierzero bench`: this machine's disk, copy and compute speeds, side by side in one run.

Runs the interleaved disk plan of `tierzero.planning.diskbench.DiskBench` (raw direct I/O, the NVMe
store at several chunk sizes, optionally fio) and the compute measurements of
`tierzero.planning.speeds` under one progress bar, prints a table with the store's ratios to raw
and to fio, and can write the report as the profile `tierzero plan --profile` reads.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from tierzero.cli.output import Output
from tierzero.storage.durable import write_atomic
from tierzero.storage.host import HostPool
from tierzero.storage.io import IOLoop

from tierzero.config import PIECE_NUMEL, parse_bytes
from tierzero.errors import ConfigError
from tierzero.planning import speeds as compute_bench
from tierzero.planning.diskbench import FOOTPRINT, DiskBench, Step

IO_THREADS = 16
MAX_SIZE_BYTES = 16 << 30


# the options of `tierzero bench`, each declared once with its help text
Directory = Annotated[
    Path | None,
    typer.Option(
        "--path",
        help="Directory on the drive to measure (a temp dir is made inside it and removed). "
        "Default: the current directory.",
    ),
]
Size = Annotated[
    str,
    typer.Option(
        "--size",
        help="Bytes written and read per measurement, e.g. 1GiB or 256MB "
        f"(the disk needs {FOOTPRINT}x free).",
    ),
]
Rounds = Annotated[
    int,
    typer.Option(
        "--rounds", help="Interleaved rounds: throughputs are the best of them, ratios the median."
    ),
]
Fio = Annotated[
    bool,
    typer.Option(
        "--fio",
        help="Also run fio (direct I/O, random data refilled per request; a sweep of libaio, "
        "psync and io_uring up to the store's 16 submitters, then its best in every round; "
        "timed over its wall span) and print store / fio.",
    ),
]
MaxSeconds = Annotated[
    float,
    typer.Option(
        "--max-seconds",
        help="Time limit: later rounds and other chunk sizes that would start after it are "
        "skipped (layout, the fio sweep, the first round and the compute measurements always "
        "run).",
    ),
]
ComputeSeconds = Annotated[
    float,
    typer.Option("--compute-seconds", help="Seconds spent on each compute and copy measurement."),
]
ProfileOut = Annotated[
    Path | None,
    typer.Option(
        "--profile-out", help="Write the report as a profile for `tierzero plan --profile`."
    ),
]
JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


def bench(
    path: Directory = None,
    size: Size = "1GiB",
    rounds: Rounds = 5,
    fio: Fio = False,
    max_seconds: MaxSeconds = 600,
    compute_seconds: ComputeSeconds = 0.5,
    profile_out: ProfileOut = None,
    json_out: JsonOut = False,
) -> None:
    """Measure NVMe store throughput against raw direct I/O (and fio), host<->GPU copies,
    CPU AdamW and matmul speed."""
    nbytes = parse_bytes(size, "--size")
    if not 1 << 20 <= nbytes <= MAX_SIZE_BYTES:
        raise ConfigError(f"--size {size} is out of range: use 1MiB to 16GiB")
    if not math.isfinite(max_seconds) or max_seconds <= 0:
        raise ConfigError(f"--max-seconds must be a finite positive number, got {max_seconds}")
    if not math.isfinite(compute_seconds) or compute_seconds <= 0:
        raise ConfigError(
            f"--compute-seconds must be a finite positive number, got {compute_seconds}"
        )
    out = Output(json_out)
    directory = str((path or Path.cwd()).resolve())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {
        "path": directory,
        "adam": {},
        "compute": {"device": device},
        "h2d": {} if device == "cuda" else None,
    }
    compute_steps = _compute_steps(report, compute_seconds)
    with (
        IOLoop(IO_THREADS) as io_loop,
        HostPool(nbytes, alignment=4096) as pool,
        DiskBench(directory, nbytes, io_loop, pool, rounds=rounds, fio=fio) as disk,
    ):
        _run(out, [*disk.steps(), *compute_steps], max_seconds)
        report.update(disk.result())
    if profile_out is not None:
        write_atomic(profile_out, (json.dumps(report, indent=2) + "\n").encode())
    if json_out:
        out.emit_json(report)
    else:
        _print_report(out, report)
        if profile_out is not None:
            out.print(f"profile written to {escape(str(profile_out))}", highlight=False)


def _compute_steps(report: dict[str, Any], seconds: float) -> list[Step]:
    """The compute and copy measurements, each a step that writes its figure into its section
    of `report`: CPU AdamW, matmul in fp32 and bf16 on the compute device, host->GPU copies."""
    device = report["compute"]["device"]
    # CPU bf16 matmul runs at ~1 GFLOP/s on small machines
    matmul_n = 8192 if device == "cuda" else 512

    def measure(label: str, section: dict[str, Any], key: str, fn: Any, **kwargs: Any) -> Step:
        def run() -> None:
            # four significant figures, not three decimals: a loaded CPU's bf16 matmul runs at
            # a few GFLOP/s, which three decimals of TFLOP/s rounded to 0 (a rate of zero)
            section[key] = float(f"{fn(seconds=seconds, **kwargs):.4g}")

        return Step(label, run)

    matmul = compute_bench.matmul_tflops
    steps = [
        measure("CPU AdamW", report["adam"], "params_per_s", compute_bench.adam_params_per_s),
        measure(
            f"matmul fp32 ({device})",
            report["compute"],
            "fp32_tflops",
            matmul,
            dtype=torch.float32,
            n=matmul_n,
            device=device,
        ),
        measure(
            f"matmul bf16 ({device})",
            report["compute"],
            "bf16_tflops",
            matmul,
            dtype=torch.bfloat16,
            n=matmul_n,
            device=device,
        ),
    ]
    if report["h2d"] is not None:
        h2d = compute_bench.h2d_gbps
        steps += [
            measure("host->GPU pinned", report["h2d"], "pinned_gbps", h2d),
            measure("host->GPU pageable", report["h2d"], "pageable_gbps", h2d, pinned=False),
        ]
    return steps


def _run(out: Output, steps: list[Step], max_seconds: float) -> None:
    """Run `steps` in order; a group that would start after `max_seconds` is skipped whole."""
    start = time.perf_counter()
    group, skip = 0, False
    with Progress(
        TextColumn("{task.description:<48}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out.console,
        transient=True,
    ) as progress:
        task = progress.add_task("bench", total=len(steps))
        for step in steps:
            if step.group != group:
                group = step.group
                skip = group != 0 and time.perf_counter() - start > max_seconds
            if not skip:
                progress.update(task, description=step.label)
                step.run()
            progress.advance(task)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _print_report(out: Output, r: dict[str, Any]) -> None:
    """What was measured and how, the disk table and its median ratios, then the compute and
    copy measurements."""
    nvme, fio, ratios = r["nvme"], r["fio"], r["ratios"]
    mode = "O_DIRECT" if nvme["direct_io"] else "buffered (no O_DIRECT here), cold via fadvise"
    out.print(
        f"[bold]tierzero bench[/] {escape(r['path'])}: {nvme['bytes'] / 1e9:.2f} GB per run, "
        f"{nvme['shard_bytes'] >> 20} MiB shards, {IO_THREADS} threads, {mode}, "
        f"best of {nvme['rounds']} interleaved rounds; random data, reads of the slot "
        f"written a round earlier"
    )
    if nvme["rounds"] < nvme["rounds_planned"]:
        out.print(
            f"[yellow]--max-seconds reached: {nvme['rounds']} of "
            f"{nvme['rounds_planned']} rounds ran; skipped chunk sizes show '-'[/]"
        )
    out.print(_disk_table(nvme, fio))
    out.print(
        f"store / raw, median of interleaved rounds: write {_fmt(ratios['write_vs_raw'])}, "
        f"read {_fmt(ratios['read_vs_raw'])}"
    )
    if fio:
        out.print(
            f"store / fio, median of interleaved rounds: write "
            f"{_fmt(ratios['write_vs_fio'])}, read {_fmt(ratios['read_vs_fio'])} (fio best: "
            f"write {fio['write_config']}, read {fio['read_config']})"
        )
        for engine, why in fio["engines_skipped"].items():
            out.print(f"[yellow]fio sweep without {engine}: {escape(why)}[/]")
    out.print(_compute_table(r))


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _disk_table(nvme: dict[str, Any], fio: dict[str, Any] | None) -> Table:
    """Raw direct I/O, fio and the store at each chunk size, best figures and their ratios."""
    disk = Table(title="disk, GB/s (1e9 B/s), cold reads; ratios of best figures")
    for col in ("", "write", "read", "write / raw", "read / raw", "write / fio", "read / fio"):
        disk.add_column(col, justify="right" if col else "left", no_wrap=not col)
    disk.add_row(
        "raw, 8 MiB blocks",
        _fmt(nvme["raw_write_gbps"]),
        _fmt(nvme["raw_read_gbps"]),
        "",
        "",
        "",
        "",
    )
    if fio:
        disk.add_row(
            "fio, wall span (best)", _fmt(fio["write_gbps"]), _fmt(fio["read_gbps"]), "", "", "", ""
        )
        disk.add_row(
            "[dim]fio, its own figure[/]",
            _fmt(fio["write_gbps_fio_reported"]),
            _fmt(fio["read_gbps_fio_reported"]),
            "",
            "",
            "",
            "",
        )
    for row in nvme["chunk_sweep"]:
        default = row["chunk_bytes"] == nvme["chunk_bytes"]
        label = f"store {row['chunk_bytes'] >> 20} MiB" + (" (default)" if default else "")
        w, rd = row["write_gbps"], row["read_gbps"]
        disk.add_row(
            f"[bold]{label}[/]" if default else label,
            _fmt(w),
            _fmt(rd),
            _fmt(_ratio(w, nvme["raw_write_gbps"])),
            _fmt(_ratio(rd, nvme["raw_read_gbps"])),
            _fmt(_ratio(w, fio and fio["write_gbps"])),
            _fmt(_ratio(rd, fio and fio["read_gbps"])),
        )
    return disk


def _compute_table(r: dict[str, Any]) -> Table:
    """CPU AdamW, matmul in fp32 and bf16, and the host->GPU copies (where there is CUDA)."""
    other = Table(title=f"compute and copies ({r['compute']['device']})")
    other.add_column("measurement")
    other.add_column("value", justify="right")
    other.add_row(
        f"CPU AdamW (fused, {PIECE_NUMEL >> 20}Mi-element piece), params/s",
        f"{r['adam']['params_per_s']:.3g}",
    )
    other.add_row("matmul fp32, TFLOP/s", f"{r['compute']['fp32_tflops']:.3g}")
    other.add_row("matmul bf16, TFLOP/s", f"{r['compute']['bf16_tflops']:.3g}")
    if r["h2d"] is not None:
        other.add_row("host->GPU pinned, GB/s", f"{r['h2d']['pinned_gbps']:.3g}")
        other.add_row("host->GPU pageable, GB/s", f"{r['h2d']['pageable_gbps']:.3g}")
    else:
        other.add_row("host->GPU", "no CUDA device")
    return other
