"""The out-of-core benchmark's report as tables: what was trained against what RAM, the peaks
and the bounds (`print_report`), then one column per training step. `out_of_core.py` measures;
this prints the report it built, whose keys it reads."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

GB = 1e9


def gb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GB:,.2f} GB"


def ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def print_report(out: Console, r: dict[str, Any]) -> None:
    """The run in one table (what it trained, the peaks, the steps' medians), then one column
    per step, then the notes."""
    summary = Table(title="out of core: training state vs RAM", show_header=False)
    summary.add_column("what")
    summary.add_column("value")
    for what, value in [*_setup_rows(r), *_peak_rows(r), *_median_rows(r)]:
        summary.add_row(what, value)
    out.print(summary)
    out.print(_per_step_table(r))
    if not r["rss"]["hwm_resettable"]:
        out.print(
            "note: /proc/self/clear_refs was refused, so every VmHWM is the peak since the "
            "process started"
        )
    for note in r["notes"]:
        out.print(f"note (engine): {note}", highlight=False)


def _setup_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The model, its state against RAM, the budgets, the drive and the materialise time."""
    a, m, d = r["model"], r["machine"], r["disk"]
    return [
        (
            "model",
            f"dim {a['dim']} x {a['n_layers']} layers, {a['n_heads']} heads, ffn {a['ffn_dim']}, "
            f"vocab {a['vocab_size']} untied; {r['params']:,} params ({r['params'] / 1e9:.3f}B)",
        ),
        (
            "training state",
            f"{gb(r['state_bytes'])} ({r['state_bytes_per_param']:.2f} B/param, "
            f"{r['dtype']} compute, {r['formats']}, every kind on NVMe) = "
            f"{r['state_bytes'] / m['ram_bytes']:.2f}x RAM",
        ),
        ("RAM (MemTotal)", gb(m["ram_bytes"])),
        ("host budget", f"{gb(r['host_budget_bytes'])} ({r['host_fraction']:.2f}x RAM)"),
        (
            "device pool budget",
            f"{gb(r['gpu_budget_bytes'])} ({r['device']}"
            + (": host memory too" if r["device"] == "cpu" else "")
            + ")",
        ),
        (
            "disk",
            f"{r['path']}: {gb(d['free_bytes'])} free, this run needs {gb(d['need_bytes'])}; "
            f"used at its peak {gb(r['disk_peak_bytes'])}",
        ),
        (
            "disk bandwidth (store)",
            f"read {d['read_gbps']:.2f} GB/s, write {d['write_gbps']:.2f} GB/s "
            f"({d['bytes'] / GB:.2f} GB, direct I/O {d['direct_io']}; raw direct "
            f"I/O read {d['raw_read_gbps']:.2f}, write {d['raw_write_gbps']:.2f})",
        ),
        (
            "materialise",
            f"{r['materialise_s']:.1f} s ({r['state_bytes'] / r['materialise_s'] / GB:.2f} GB/s "
            f"of state written)",
        ),
    ]


def _peak_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """Peak resident memory per phase, and training's against the budgets."""
    rss = r["rss"]
    rows = [
        (
            f"peak RSS, {phase}",
            f"VmHWM {gb(rss['hwm'][phase])}, sampled VmRSS max "
            f"{gb(rss['sampled'][phase])} (VmRSS at its start "
            f"{gb(rss['start'][phase])})",
        )
        for phase in ("disk measurement", "materialise", "training")
    ]
    peak, host, device = rss["hwm"]["training"], r["host_budget_bytes"], r["gpu_budget_bytes"]
    rows.append(
        (
            "peak RSS, training / budgets",
            f"{peak / host:.2f}x the host budget"
            + (
                f", {peak / (host + device):.2f}x host + device pool budgets"
                if r["device"] == "cpu"
                else ""
            ),
        )
    )
    return rows


def _median_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The steps' medians: time, NVMe bytes, I/O wait, the I/O bounds; the losses; the time."""
    s = r["summary"]
    return [
        ("step time (median)", f"{s['step_s']:.1f} s"),
        (
            "NVMe bytes / param / step",
            f"{s['nvme_bytes_per_param']:.1f} (read {s['read_per_param']:.1f}, "
            f"written {s['write_per_param']:.1f})",
        ),
        ("I/O wait share", f"{s['io_wait_share']:.0%} (engine's io_wait_s)"),
        ("optimizer share", f"{s['optimizer_share']:.1%} (engine's busy_s/optimizer)"),
        (
            "I/O bound serial / overlapped",
            f"{s['bound_serial_s']:.1f} s / {s['bound_overlapped_s']:.1f} s",
        ),
        (
            "step / bound",
            f"{ratio(s['ratio_serial'])} serial, {ratio(s['ratio_overlapped'])} overlapped",
        ),
        ("loss", " -> ".join(f"{x['loss']:.3f}" for x in r["steps"])),
        (
            "time",
            f"materialise + steps {r['run_s'] / 60:.1f} min "
            f"(estimated {r['estimate']['total_s'] / 60:.1f} min); "
            f"measuring first {r['bench_s']:.0f} s; {r['wall_s'] / 60:.1f} min in all",
        ),
    ]


def _per_step_table(r: dict[str, Any]) -> Table:
    """One column per step, one row per measure: the engine's counters are whatever it
    reports."""
    keys = sorted({k for x in r["steps"] for k in x["stats"] if k.startswith(("bytes_", "peak_"))})
    table = Table(title="per step (engine counters as `engine.stats()` names them; OS: /proc/self)")
    table.add_column("measure")
    for x in r["steps"]:
        table.add_column(f"step {x['step']}", justify="right")
    measures = [("loss", lambda x: f"{x['loss']:.4f}"), ("time", lambda x: f"{x['seconds']:.1f} s")]
    measures += [(k, lambda x, k=k: gb(x["stats"].get(k))) for k in keys]
    measures += [
        ("OS read_bytes (/proc/self/io)", lambda x: gb(x["os_read_bytes"])),
        ("OS write_bytes (/proc/self/io)", lambda x: gb(x["os_write_bytes"])),
        ("NVMe bytes / param", lambda x: f"{x['nvme_bytes_per_param']:.1f}"),
        ("I/O wait (io_wait_s / step)", lambda x: f"{x['io_wait_share']:.0%}"),
        ("optimizer (busy_s / step)", lambda x: f"{x['optimizer_share']:.1%}"),
        (
            "peak RSS: VmHWM / sampled",
            lambda x: f"{gb(x['peak_rss_bytes'])} / {gb(x['peak_rss_sampled_bytes'])}",
        ),
        ("I/O bound serial", lambda x: f"{x['bound_serial_s']:.2f} s"),
        ("step / serial bound", lambda x: ratio(x["ratio_serial"])),
        ("I/O bound overlapped", lambda x: f"{x['bound_overlapped_s']:.2f} s"),
        ("step / overlapped bound", lambda x: ratio(x["ratio_overlapped"])),
    ]
    for name, cell in measures:
        table.add_row(name, *(cell(x) for x in r["steps"]))
    return table
