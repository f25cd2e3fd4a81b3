"""`tierzero train` on one rank: the run directory and session opened, what the run says as it
trains (its notes, its header, the progress bar) and the summary it ends with, the drives' wear
included. Only rank 0 prints; it speaks for the run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from tierzero.cli.output import Output
from tierzero.cli.plan import wear_lines

from tierzero.config import DType, LongExamples, OptimizerDevice, RunConfig
from tierzero.distributed.launch import Ranks
from tierzero.planning.machine import process_written_bytes
from tierzero.planning.peaks import format_bytes
from tierzero.planning.placement import STAGE_TEXT
from tierzero.planning.statebytes import StateBytes
from tierzero.planning.wear import DriveWear
from tierzero.run.directory import RunDir
from tierzero.run.packing import Fitted
from tierzero.run.trackers import reporting

# what a run's drive wear is measured by: the steps' writes, then the process's beyond them
_MEASURED_BY = ["engine NVMe write counters (bytes_host->nvme)", "/proc/self/io write_bytes"]


def train_on_rank(
    run: RunConfig, ranks: Ranks, resume: bool, overwrite: bool, json_out: bool
) -> None:
    """Train on this rank; only rank 0 prints, and it speaks for the run."""
    from tierzero.run.session import open_session

    out = Output(json_out, quiet=not ranks.primary)
    if resume and run.engine.streaming.piece_numel is None:
        # its shards are keyed by it, whatever the budgets choose now
        run = run.replace(piece_numel=_checkpoint_piece_numel(run.run_dir))
    with (
        _open_run_dir(run, ranks, resume, overwrite) as (rundir, notes),
        open_session(run, ranks) as session,
    ):
        start_step = 0
        if resume:
            start_step, resumed = session.resume(rundir)
            notes = [*notes, *resumed]
        batches = [session.batches.note] if session.batches.note else []
        _print_notes(out, [*notes, *session.model.notes, *batches])
        if resume:  # a new run's config was written first, in `start`
            rundir.write_config(run)
        _print_header(out, run, ranks, session)
        if start_step >= run.steps:
            out.print(
                f"the run is already at step {start_step} of {run.steps}: nothing to train; "
                "raise --steps to go on"
            )
            if json_out:
                out.emit_json(
                    {"run_dir": run.run_dir, "steps": run.steps, "start_step": start_step}
                )
            return
        process_before = process_written_bytes()
        result, nvme_bytes = _train_steps(out, run, session, rundir, start_step, resume)
        _print_notes(out, session.notes())
    # this rank's process only
    process = process_written_bytes() if ranks.world_size == 1 else None
    process = None if process is None or process_before is None else process - process_before
    checkpoints = _checkpoints(run, start_step, session)
    wear = DriveWear.measured(
        run.steps - start_step, nvme_bytes, process, checkpoints, run.reporting.drive_tbw
    )
    if json_out:
        out.emit_json(_summary(run, session, start_step, result, wear, process is not None))
    else:
        _print_summary(out, run, result, wear, process is not None)


def _print_notes(out: Output, notes: list[str]) -> None:
    for note in notes:
        out.print(f"[yellow]note:[/] {escape(note)}", highlight=False)


def _print_header(out: Output, run: RunConfig, ranks: Ranks, session: Any) -> None:
    """What trains where: the model, its device and dtype, where its state lives, and what is
    not plain (compact optimizer state, long examples cut, the ZeRO stage of several ranks)."""
    out.print(
        f"[bold]tierzero train[/] {escape(run.model)} ({session.n_params / 1e6:.2f}M params) "
        f"on {session.device}, dtype {session.dtype}, "
        f"offload {run.engine.tiering.offload.value}: {session.placement_text}"
    )
    formats = StateBytes.for_compute(
        run.engine.formats.optimizer_state, run.engine.formats.master, DType(session.dtype)
    )
    if formats.compact:
        out.print(f"optimizer state: {formats.describe()}", highlight=False)
    parts = getattr(session.trainer, "parts", None)
    if parts is not None and (
        session.device != "cpu" or run.engine.execution.optimizer_device is not OptimizerDevice.AUTO
    ):
        out.print(f"optimizer: steps {parts.step_reason}", highlight=False)
    if session.fitted is not None and session.fitted.long:
        out.print(f"[yellow]note:[/] {_long_examples_text(session.fitted)}", highlight=False)
    if ranks.world_size > 1:  # several ranks train an Engine, never the in-memory trainer
        parts = session.trainer.parts
        stage = parts.layout.stage
        out.print(
            f"ZeRO stage {stage} ({parts.stage_reason}): {STAGE_TEXT[stage]}", highlight=False
        )


def _train_steps(
    out: Output, run: RunConfig, session: Any, rundir: RunDir, start_step: int, resume: bool
) -> tuple[Any, int]:
    """Train from `start_step` to the run's last step under a progress bar, with the run's
    trackers; the result, and the bytes the steps wrote to NVMe by the engine's write counters
    (every rank's)."""
    progress = Progress(
        TextColumn("step"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(),
        console=out.console,
        disable=out.json_mode or out.quiet,
    )
    rundir.open_metrics(start_step)
    task = progress.add_task(
        "train", total=run.steps, completed=start_step, loss=float("nan"), tps=0.0
    )
    nvme_written = [0]

    def on_step(step: int, record: dict[str, Any]) -> None:
        ranks_stats = record.get("ranks", [record])
        nvme_written[0] += sum(int(r.get("bytes_host->nvme", 0)) for r in ranks_stats)
        # drawn from the first finished step on: a refusal in the first step stands alone,
        # after no "step 0/N loss nan 0 tok/s"
        progress.update(task, completed=step, loss=record["loss"], tps=record["tokens_per_s"])
        progress.start()

    try:
        with reporting(run, rundir, start_step, resume) as trackers:
            for where in trackers:
                out.print(f"reporting to {escape(where)}", highlight=False)
            result = session.train(rundir, on_step, start_step=start_step)
    finally:
        if progress.live.is_started:
            progress.stop()
    return result, nvme_written[0]


def _summary(
    run: RunConfig,
    session: Any,
    start_step: int,
    result: Any,
    wear: DriveWear,
    process_counted: bool,
) -> dict[str, Any]:
    """The finished run, as `--json` prints it; `process_counted`: whether the kernel counted
    what the process wrote beyond the steps."""
    summary = {
        "run_dir": run.run_dir,
        "steps": run.steps,
        "start_step": start_step,
        "first_loss": result.first_loss,
        "last_loss": result.last_loss,
        "eval_loss_start": result.val_losses[0][1] if result.val_losses else None,
        "eval_loss_end": result.val_losses[-1][1] if result.val_losses else None,
        "best_checkpoint": result.best,
        "wall_s": result.wall_s,
    }
    if session.fitted is not None:
        summary["long_examples"] = {
            "policy": session.fitted.policy.value,
            "examples": session.fitted.examples,
            "touched": session.fitted.long,
        }
    summary["drive_wear"] = {
        **wear.as_dict(),
        "measured_by": _MEASURED_BY[: 2 if process_counted else 1],
    }
    return summary


def _print_summary(
    out: Output, run: RunConfig, result: Any, wear: DriveWear, process_counted: bool
) -> None:
    """The finished run for a person: its losses, its best checkpoint and its NVMe writes."""
    evaluated = (
        f", eval loss {result.val_losses[0][1]:.4f} -> {result.val_losses[-1][1]:.4f}"
        if result.val_losses
        else ""
    )
    out.print(
        f"loss {result.first_loss:.4f} -> {result.last_loss:.4f}{evaluated} in "
        f"{result.wall_s:.1f}s; metrics in {escape(run.run_dir)}/metrics.jsonl",
        highlight=False,
    )
    if result.best is not None:
        out.print(
            f"best checkpoint: step {result.best['step']} "
            f"(eval loss {result.best['eval_loss']:.4f}), "
            f"{escape(run.run_dir)}/{result.best.get('checkpoint', '')}",
            highlight=False,
        )
    rest = (
        f"; {format_bytes(wear.checkpoint_bytes)} more by checkpoints and logs (/proc/self/io)"
        if process_counted
        else ""
    )
    out.print(
        f"NVMe writes: {format_bytes(wear.step_bytes)} over {wear.steps} steps, "
        f"{format_bytes(round(wear.per_step_bytes))} per step (the engine's write counters)"
        f"{rest}",
        highlight=False,
    )
    for line in wear_lines(wear):
        out.print(line, highlight=False)


def _checkpoints(run: RunConfig, start_step: int, session: Any) -> int:
    """The checkpoints this run took (a tiered run: every --checkpoint-every steps and at the
    end)."""
    if not hasattr(session.trainer, "save_checkpoint"):
        return 0
    every = run.checkpoints.checkpoint_every or run.steps
    return sum(1 for s in range(start_step + 1, run.steps + 1) if s % every == 0 or s == run.steps)


def _long_examples_text(fitted: Fitted) -> str:
    """What --long-examples did, in one sentence."""
    done = {
        LongExamples.TRUNCATE: "truncated, keeping each prompt's end and reply's start",
        LongExamples.SPLIT: "split into windows (later ones train without their prompt)",
        LongExamples.DROP: "dropped",
    }[fitted.policy]
    return (
        f"{fitted.long} of {fitted.examples} examples are longer than --seq-len "
        f"{fitted.window - 1} allows ({fitted.window} tokens with the last target): {done} "
        f"(--long-examples {fitted.policy.value})"
    )


def _checkpoint_piece_numel(run_dir: str) -> int | None:
    """The piece size the run's newest checkpoint was written with (its manifest records it);
    None: no checkpoint yet, or one that predates the record. Integrity is the load's to check."""
    from tierzero.checkpoint.catalog import newest_checkpoint

    found = newest_checkpoint(run_dir, verify=False)
    value = found[1].engine.get("piece_numel") if found is not None else None
    return value if isinstance(value, int) and value > 0 else None


@contextmanager
def _open_run_dir(
    run: RunConfig, ranks: Ranks, resume: bool, overwrite: bool
) -> Iterator[tuple[RunDir, list[str]]]:
    """The locked run directory with its identity written and its lineage begun or continued,
    and what to tell the user."""
    from tierzero.distributed.comm import Comm

    with RunDir(run.run_dir, primary=ranks.primary) as rundir:
        notes = rundir.start(run, resume, overwrite)
        Comm().barrier()  # rank 0 holds the run directory's lock before any rank writes into it
        yield rundir, notes
