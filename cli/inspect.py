"""`tierzero inspect`: a run's checkpoints, stored arrays per tier and config, read-only."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich import box
from rich.markup import escape
from rich.table import Table
from tierzero.cli.output import Output

from tierzero.checkpoint.inspect import RunInfo, inspect_run

_STATUS_STYLE = {"ok": "green", "complete": "green", "incomplete": "yellow", "damaged": "bold red"}


def inspect(
    run_dir: Path = typer.Argument(..., help="A run directory written by `tierzero train`."),
    verify: bool = typer.Option(
        False, "--verify", help="Read every checkpoint chunk and check its crc32c."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """List a run's checkpoints, the arrays its NVMe stores hold per state kind, and its config.
    Takes no lock and writes nothing, so it is safe beside a running trainer."""
    info = inspect_run(run_dir, verify=verify)
    output = Output(json_out)
    if json_out:
        output.emit_json(info.to_dict())
        return
    output.print(_checkpoints(info))
    for reason in info.skipped:  # what a resume or export passes over, and why
        output.print(f"[yellow]skipped[/] newer checkpoint: {escape(reason)}", highlight=False)
    output.print(_stores(info))
    for store in info.stores:
        for reason in store.skipped:
            output.print(f"[yellow]skipped[/] {escape(reason)}", highlight=False)
    output.print(_config(info))


def _checkpoints(info: RunInfo) -> Table | str:
    if not info.checkpoints:
        return f"run {escape(str(info.run_dir))}: no checkpoints"
    table = Table(title=f"checkpoints of {escape(str(info.run_dir))}", box=box.SIMPLE)
    for column in ("step", "time", "state", "copied", "status"):
        table.add_column(
            column, justify="right" if column in ("step", "state", "copied") else "left"
        )
    for c in info.checkpoints:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.time)) if c.time else "-"
        style = _STATUS_STYLE.get(c.status, "")
        status = f"[{style}]{c.status}[/]" + (f": {escape(c.reason)}" if c.reason else "")
        table.add_row(str(c.step), when, _mb(c.nbytes), _mb(c.bytes_copied), status)
    return table


def _stores(info: RunInfo) -> Table:
    table = Table(title="state kinds: home tier and NVMe arrays", box=box.SIMPLE)
    for column in ("kind", "tier", "arrays", "bytes"):
        table.add_column(column, justify="right" if column in ("arrays", "bytes") else "left")
    for kind, tier in info.placement.items():
        totals = [s.kinds[kind] for s in info.stores if kind in s.kinds]
        arrays = sum(t.arrays for t in totals)
        table.add_row(
            kind,
            tier,
            str(arrays) if totals else "-",
            _mb(sum(t.nbytes for t in totals)) if totals else "-",
        )
    others = sorted({k for s in info.stores for k in s.kinds} - set(info.placement))
    for kind in others:
        totals = [s.kinds[kind] for s in info.stores if kind in s.kinds]
        table.add_row(
            kind, "nvme", str(sum(t.arrays for t in totals)), _mb(sum(t.nbytes for t in totals))
        )
    paths = (
        ", ".join(escape(s.path) + ("" if s.exists else " (missing)") for s in info.stores)
        or "none"
    )
    table.caption = (
        f"NVMe paths: {paths}; host and GPU state lives in memory only while a run is open"
    )
    return table


def _config(info: RunInfo) -> Table | str:
    if info.config is None:
        return f"config: {escape(info.config_error)}"
    table = Table(title="config.toml", box=box.SIMPLE, show_header=False)
    for key in sorted(info.config):
        table.add_row(escape(key), escape(str(info.config[key])))
    return table


def _mb(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:,.1f} MB"
