"""`tierzero report`: a run's metrics as a summary and a PNG."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table
from tierzero.cli.output import Output

from tierzero.run.charts import load_run, plot, summarize
from tierzero.run.overlap import overlap


def report(
    run_dir: Path = typer.Argument(..., help="A run directory written by `tierzero train`."),
    out: Path | None = typer.Option(
        None, "--out", help="PNG to write. Default: RUN_DIR/report.png."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Summarize a run and plot its loss, throughput, tier traffic and how its links overlap."""
    records = load_run(run_dir)
    summary = summarize(records)
    summary["overlap"] = overlap(records)
    png = plot(records, out or run_dir / "report.png")
    summary["png"] = str(png)
    output = Output(json_out)
    if json_out:
        output.emit_json(summary)
        return
    table = Table(title=f"run {escape(str(run_dir))}", show_header=False)
    for key in (
        "steps",
        "first_loss",
        "last_loss",
        "eval_loss",
        "eval_ppl",
        "median_tokens_per_s",
        "wall_s",
    ):
        value = summary[key]
        table.add_row(key, f"{value:,.4g}" if isinstance(value, float) else str(value))
    if summary["best_eval"] is not None:
        table.add_row(
            "best eval",
            f"{summary['best_eval']['eval_loss']:,.4g} at step {summary['best_eval']['step']}",
        )
    for tier, nbytes in summary["peak_bytes"].items():
        table.add_row(f"peak {tier}", f"{nbytes / 1e6:,.1f} MB")
    output.print(table)
    output.print(_overlap_table(summary["overlap"]))
    output.print(f"plot: {escape(str(png))}", highlight=False)


def _overlap_table(figures: dict) -> Table | str:
    """Each link's busy time against the step's: is the step near its slowest link's time?"""
    if not figures["measured"]:
        return f"overlap: {figures['note']}"
    table = Table(title=f"overlap (median over {figures['steps']} steps)")
    for column in ("link", "busy s", "share of step", "GB/s while busy"):
        table.add_column(column, justify="left" if column == "link" else "right")
    step_s = figures["step_s"]
    for link, f in figures["links"].items():
        rate = "-" if f["bytes_per_s"] is None else f"{f['bytes_per_s'] / 1e9:,.3f}"
        table.add_row(link, f"{f['busy_s']:.4f}", f"{f['busy_s'] / step_s:.1%}", rate)
    table.add_section()
    table.add_row("step", f"{step_s:.4f}", "", "")
    table.add_row(f"bound ({figures['bound_link']})", f"{figures['bound_s']:.4f}", "", "")
    table.add_row("compute (step - io wait)", f"{figures['compute_s']:.4f}", "", "")
    table.caption = (
        "step / bound 1.0: the links overlap fully; serial / bound: they run in turn; "
        "step / floor: the step against max(bound, compute)"
    )
    for key in ("step_over_bound", "serial_over_bound", "step_over_floor"):
        value = figures[key]
        label = key.replace("_over_", " / ")
        table.add_row(label, "-" if value is None else f"{value:.2f}", "", "")
    return table
