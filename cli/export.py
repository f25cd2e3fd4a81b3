"""`tierzero export`: a run's checkpoint as safetensors weights under the model's own names."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from tierzero.cli.output import Output

from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.checkpoint.export import export_checkpoint
from tierzero.config import parse_bytes
from tierzero.errors import CheckpointError, RunDirError
from tierzero.run.directory import CONFIG_NAME, read_metrics

# the options of `tierzero export`, each declared once with its help text
RunDir = Annotated[Path, typer.Argument(help="A run directory written by `tierzero train`.")]
Out = Annotated[
    Path,
    typer.Option(
        "--out",
        help="The .safetensors file to write, or a directory (created if missing) for "
        "model.safetensors.",
    ),
]
Step = Annotated[
    int | None,
    typer.Option("--step", help="The checkpoint's step. Default: the newest complete one."),
]
Dtype = Annotated[
    str,
    typer.Option(
        "--dtype", help="fp32 (the master weights as they are) or bf16 (rounded from them)."
    ),
]
MaxShardSize = Annotated[
    str,
    typer.Option(
        "--max-shard-size",
        help="Split into model-0000i-of-0000K files with an index past this size, e.g. 5GB or "
        "500MiB.",
    ),
]
Tensors = Annotated[
    str,
    typer.Option(
        "--tensors",
        help="An hf: model's tensors as save_pretrained writes them (saved: a Mixture-of-Experts "
        "layer's experts one tensor each, as on the hub) or as the model holds them (model: "
        "fused experts); from_pretrained loads either.",
    ),
]
Merge = Annotated[
    bool,
    typer.Option(
        "--merge",
        help="A LoRA run: write the base model with the adapter merged in (loads with "
        "from_pretrained) instead of the peft adapter (loads with "
        "PeftModel.from_pretrained).",
    ),
]
JsonOut = Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")]


def export(
    run_dir: RunDir,
    out: Out,
    step: Step = None,
    dtype: Dtype = "fp32",
    max_shard_size: MaxShardSize = "5GB",
    tensors: Tensors = "saved",
    merge: Merge = False,
    json_out: JsonOut = False,
) -> None:
    """Write a checkpoint's master weights as safetensors, loadable with `load_file` and
    `model.load_state_dict`, streaming one unit at a time (host memory: about one unit).
    For an hf: model, export to a directory: its config.json is written too, for `from_pretrained`,
    and the tokenizer files of the directory the run started from are copied there."""
    max_shard_bytes = parse_bytes(max_shard_size, "--max-shard-size")
    output = Output(json_out)
    _refuse_untrained(run_dir)
    # a transient bar on what is not a terminal leaves a blank line behind: only on a terminal
    progress = Progress(
        TextColumn("export"),
        MofNCompleteColumn(),
        TextColumn("units"),
        BarColumn(),
        TimeElapsedColumn(),
        console=output.console,
        transient=True,
        disable=json_out or not output.console.is_terminal,
    )
    with progress:
        task = progress.add_task("export", total=None)
        result = export_checkpoint(
            run_dir,
            out,
            step=step,
            dtype=dtype.lower(),
            max_shard_bytes=max_shard_bytes,
            merge=merge,
            tensors=tensors.lower(),
            on_unit=lambda done, total: progress.update(task, completed=done, total=total),
        )
    summary = {
        "run_dir": str(run_dir),
        "step": result.step,
        "checkpoint": str(result.checkpoint),
        "dtype": result.dtype,
        "files": [str(f) for f in result.files],
        "index": str(result.index) if result.index else None,
        "tensors": result.tensors,
        "bytes": result.nbytes,
        "config": str(result.config) if result.config else None,
        "tokenizer": [str(f) for f in result.tokenizer],
        "skipped": result.skipped,
    }
    for reason in result.skipped:  # a newer checkpoint passed over is never silent
        output.print(f"[yellow]note:[/] {escape(reason)}; exported an older one", highlight=False)
    if json_out:
        output.emit_json(summary)
        return
    where = result.index if result.index else result.files[0]
    output.print(
        f"exported step {result.step} ({result.tensors} tensors, {result.nbytes / 1e6:,.1f} MB "
        f"{result.dtype}) to {escape(str(where))}"
        + (f" and {len(result.files)} files" if result.index else "")
        + (f", with the model's {escape(result.config.name)}" if result.config else "")
        + (f" and {len(result.tokenizer)} tokenizer files" if result.tokenizer else "")
    )


def _refuse_untrained(run_dir: Path) -> None:
    """A run directory `train` configured that holds no checkpoint and whose metrics record no
    finished step: its train was refused or stopped before step 1, so no checkpoint can exist."""
    if not (run_dir / CONFIG_NAME).is_file() or checkpoint_dirs(run_dir):
        return
    try:
        steps = [r for r in read_metrics(run_dir) if "loss" in r]
    except RunDirError:  # no metrics.jsonl: nothing was ever recorded
        steps = []
    if not steps:
        raise CheckpointError(
            f"run '{run_dir}' never finished a training step (its train was refused or "
            "stopped before step 1), so it has no checkpoint to export; train it first"
        )
