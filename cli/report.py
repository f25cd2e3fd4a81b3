"""`tierzero report`: a run's metrics as a summary and a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from tierzero.cli.output import Output
from tierzero.run.charts import load_run, plot, summarize


def report(
    run_dir: Path = typer.Argument(..., help="A run directory written by `tierzero train`."),
    out: Optional[Path] = typer.Option(None, "--out", help="PNG to write. Default: RUN_DIR/report.png."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Summarize a run and plot its loss, throughput and tier traffic."""
    records = load_run(run_dir)
    summary = summarize(records)
    png = plot(records, out or run_dir / "report.png")
    summary["png"] = str(png)
    output = Output(json_out)
    if json_out:
        output.emit_json(summary)
        return
    table = Table(title=f"run {escape(str(run_dir))}", show_header=False)
    for key in ("steps", "first_loss", "last_loss", "eval_loss", "eval_ppl", "median_tokens_per_s", "wall_s"):
        value = summary[key]
        table.add_row(key, f"{value:,.4g}" if isinstance(value, float) else str(value))
    if summary["best_eval"] is not None:
        table.add_row("best eval", f"{summary['best_eval']['eval_loss']:,.4g} at step {summary['best_eval']['step']}")
    for tier, nbytes in summary["peak_bytes"].items():
        table.add_row(f"peak {tier}", f"{nbytes / 1e6:,.1f} MB")
    output.print(table)
    output.print(f"plot: {escape(str(png))}", highlight=False)
