"""`tierzero train`: train a built-in model on built-in or given data, in memory or tiered."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from tierzero.cli.output import Output
from tierzero.cli.plan import wear_lines
from tierzero.storage.filekind import kind_of, not_a_file

from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.config import STATE_BLOCK, DType, LongExamples, RunConfig
from tierzero.configfile import load_run_config
from tierzero.distributed.launch import (
    Ranks,
    die_with_launcher,
    rank_device,
    ranks_from_env,
    run_torchrun,
    start_process_group,
    stop_process_group,
    under_torchrun,
)
from tierzero.errors import ConfigError
from tierzero.planning.machine import process_written_bytes
from tierzero.planning.peaks import format_bytes
from tierzero.planning.placement import STAGE_TEXT
from tierzero.planning.statebytes import StateBytes
from tierzero.planning.wear import DriveWear, check_drive_tbw
from tierzero.run.directory import (
    CONFIG_NAME,
    RunDir,
    enclosing_run_dir,
    never_configured,
    rebase_paths,
    refuse_fresh_start,
)
from tierzero.run.packing import Fitted
from tierzero.run.trackers import reporting, resolve_report_to


def train(
    ctx: typer.Context,
    config: Path | None = typer.Option(
        None, "--config", help="TOML file of run and engine keys; flags override it."
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        help="Model preset (tiny, 125m, 350m, 1b, 3b, 7b, 13b, 70b, llama3-8b, llama3-70b), or hf:DIR, a local Hugging Face causal LM directory.",
    ),
    units: str | None = typer.Option(
        None,
        "--units",
        help="Attribute path of the model's repeated blocks (e.g. model.layers); default: its largest list of one block class.",
    ),
    data: str | None = typer.Option(
        None,
        "--data",
        help="A text file, a folder of text files, a .jsonl file, .parquet files or a datasets save_to_disk directory, or .bin/.npy token ids; default: the stdlib's own sources. Text is tokenized by an hf: model's tokenizer.json, else read as bytes. Records with messages (the model's chat template) or prompt/completion train on the assistant turns / completion only.",
    ),
    text_field: str | None = typer.Option(
        None,
        "--text-field",
        help="The field of each .jsonl record that holds its text (default: text).",
    ),
    weights: str | None = typer.Option(
        None,
        "--weights",
        help="Start from local .safetensors weights (a file or a directory of them).",
    ),
    lora_r: int | None = typer.Option(
        None,
        "--lora-r",
        help="Train LoRA adapters of this rank (peft) on the frozen hf:DIR base; export writes a peft adapter, or merged weights with --merge.",
    ),
    lora_alpha: float | None = typer.Option(
        None, "--lora-alpha", help="LoRA's alpha: adapters scale by alpha/r (default 16)."
    ),
    lora_dropout: float | None = typer.Option(
        None, "--lora-dropout", help="Dropout on the adapters' input (default 0)."
    ),
    lora_targets: str | None = typer.Option(
        None,
        "--lora-targets",
        help="Comma-separated module names to adapt, e.g. q_proj,v_proj (default: peft's choice for the model; where it has none, every linear layer of the decoder layers).",
    ),
    steps: int | None = typer.Option(None, "--steps", help="Optimizer steps."),
    batch_size: int | None = typer.Option(None, "--batch-size", help="Sequences per micro-batch."),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Tokens per sequence."),
    long_examples: str | None = typer.Option(
        None,
        "--long-examples",
        help="A prompt/completion or chat example longer than --seq-len: truncate (default: keep the prompt's end and the reply's start), split (into windows; later ones train without the prompt) or drop.",
    ),
    accumulate: int | None = typer.Option(
        None, "--accumulate", help="Micro-batches per optimizer step."
    ),
    schedule: str | None = typer.Option(
        None,
        "--schedule",
        help="How --accumulate micro-batches run: horizontal (each through every unit), vertical (each unit for all of them: params read once per pass, grads written once per step; built-in models and Hugging Face decoders) or auto (default: vertical when accumulating, where it applies).",
    ),
    recompute: str | None = typer.Option(
        None,
        "--recompute",
        help="Which blocks run their forward again in backward: auto (default: keep the activations of as many as the compute device's budget holds; the built-in models, horizontal schedule), all (activation checkpointing everywhere), or none (refused where they do not fit).",
    ),
    optimizer_state: str | None = typer.Option(
        None,
        "--optimizer-state",
        help=f"How the two Adam moments are stored on every tier and in checkpoints: fp32 (default: exact, bitwise torch.optim.AdamW(fused=True)), bf16 (half the bytes), or int8 (a quarter: blocks of {STATE_BLOCK} values share one fp32 absmax). Fixed for the run's life; `tierzero plan --optimizer-state` shows the bytes.",
    ),
    master: str | None = typer.Option(
        None,
        "--master",
        help="The master weights' dtype: fp32 (default: exact) or bf16 (stochastically rounded; with --dtype bf16 the param is the master, one tensor). Fixed for the run's life.",
    ),
    lr: float | None = typer.Option(None, "--lr", help="Peak learning rate."),
    weight_decay: float | None = typer.Option(
        None,
        "--weight-decay",
        help="AdamW's decoupled weight decay (default 0.1); 1-D parameters (norms, biases) get none, as in torch AdamW param groups that exclude them.",
    ),
    adam_betas: str | None = typer.Option(
        None, "--adam-betas", help="AdamW's beta1,beta2 (default 0.9,0.95)."
    ),
    adam_eps: float | None = typer.Option(
        None, "--adam-eps", help="AdamW's epsilon (default 1e-8)."
    ),
    warmup_steps: int | None = typer.Option(None, "--warmup-steps", help="Linear warmup steps."),
    clip_grad_norm: float | None = typer.Option(
        None, "--clip-grad-norm", help="Clip the global grad norm to this."
    ),
    clip_previous_norm: bool | None = typer.Option(
        None,
        "--clip-previous-norm",
        help="With --overlap-step and --clip-grad-norm: clip step k by step k-1's norm (an approximation) instead of re-stepping exactly when the clip fires.",
    ),
    seed: int | None = typer.Option(None, "--seed", help="Seed for init and data order."),
    dtype: str | None = typer.Option(None, "--dtype", help="Compute dtype: fp32, bf16 or fp16."),
    offload: str | None = typer.Option(
        None, "--offload", help="Where state lives: none (in memory), host, nvme or auto."
    ),
    nvme_path: list[str] | None = typer.Option(
        None,
        "--nvme-path",
        help="SSD directory for offloaded state; repeat once per drive. Default: RUN_DIR/nvme.",
    ),
    host_budget: str | None = typer.Option(
        None, "--host-budget", help="Host memory budget, e.g. 8GiB."
    ),
    gpu_budget: str | None = typer.Option(
        None, "--gpu-budget", help="GPU memory budget, e.g. 20GiB."
    ),
    prefetch_depth: int | None = typer.Option(
        None,
        "--prefetch-depth",
        help="Units fetched ahead of compute. Default: 2, or 1 where the budgets need it, with the largest pieces (piece_numel in a --config file; at most 16Mi elements) that fit.",
    ),
    overlap_step: bool | None = typer.Option(
        None,
        "--overlap-step/--no-overlap-step",
        help="Step each unit's optimizer during backward where exact.",
    ),
    quantize_base: str | None = typer.Option(
        None,
        "--quantize-base",
        help="Store the frozen base's linear weights in 4 bits: nf4 (bitsandbytes' NormalFloat codes, blocks of 64 with an fp32 absmax: 0.5625 bytes per weight on every tier and read; each unit decoded on the compute device as it is fetched) or none (default). Needs a frozen base (--lora-r) and bitsandbytes.",
    ),
    verify_reads: str | None = typer.Option(
        None,
        "--verify-reads",
        help="Check every NVMe read's crc32c, so a flipped bit stops the run naming the chunk: on, off, or auto (default: on where crc32c runs at 20x one thread's read speed of --nvme-path).",
    ),
    profile: Path | None = typer.Option(
        None,
        "--profile",
        help="`tierzero bench --profile-out` file; --offload auto uses it to predict step time.",
    ),
    run_dir: Path | None = typer.Option(
        None,
        "--run-dir",
        help="Where config, metrics, checkpoints and offloaded state go. Default: runs/<model>-<time>.",
    ),
    checkpoint_every: int | None = typer.Option(
        None,
        "--checkpoint-every",
        help="Checkpoint every N optimizer steps (and always at the end).",
    ),
    keep_checkpoints: int | None = typer.Option(
        None, "--keep-checkpoints", help="Keep the newest K checkpoints (default 2)."
    ),
    keep_best: bool | None = typer.Option(
        None,
        "--keep-best/--no-keep-best",
        help="Checkpoint at every evaluation that beats the run's best eval loss and keep that checkpoint (named in RUN_DIR/best.json) through --keep-checkpoints pruning.",
    ),
    val_data: str | None = typer.Option(
        None,
        "--val-data",
        help="Held-out data to evaluate on, in any format --data takes; default: a split off the end of --data.",
    ),
    val_fraction: float | None = typer.Option(
        None,
        "--val-fraction",
        help="The share of --data's end held out for evaluation, in [0, 1); default 0.05 where the corpus can spare a window, else no evaluation (with a note).",
    ),
    eval_every: int | None = typer.Option(
        None,
        "--eval-every",
        help="Evaluate every N optimizer steps, before the first and after the last (default 40; 0: never). Each evaluation reads every unit once.",
    ),
    eval_tokens: int | None = typer.Option(
        None,
        "--eval-tokens",
        help="Tokens in the evaluation set: its first windows that hold this many (default 4096).",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in --run-dir from its newest intact checkpoint, up to --steps.",
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Start a new run in a --run-dir that holds checkpoints; the old ones are moved into checkpoints/abandoned/.",
    ),
    grad_reduce_dtype: str | None = typer.Option(
        None,
        "--grad-reduce-dtype",
        help="What gradients are summed over ranks in: fp32 (default, exact) or bf16 (half the bytes).",
    ),
    overlap_comm: bool | None = typer.Option(
        None,
        "--overlap-comm/--no-overlap-comm",
        help="Several ranks: all-gather each unit's params while the one before computes, and reduce its grads while the next backward computes (default on).",
    ),
    stage: int | None = typer.Option(
        None,
        "--stage",
        help="Several ranks, ZeRO stage: 3 partitions params, grads and optimizer states (params all-gathered at each use); 2 replicates params (one all-gather per unit per step); 1 also keeps whole grads over --accumulate micro-batches (one reduction per step). Default: 1 or 2 when replicated state fits the budgets, else 3.",
    ),
    nproc: int | None = typer.Option(
        None,
        "--nproc",
        help="Ranks on this machine (one per GPU; gloo processes on a CPU): runs torchrun's launcher for you. --batch-size is the global batch, split over them.",
    ),
    drive_tbw: float | None = typer.Option(
        None,
        "--drive-tbw",
        help="The NVMe drive's rated endurance in terabytes written (its datasheet's "
        "TBW, e.g. 600; drive_tbw in a --config file): the summary says what share of it the run wrote, "
        "with a note above 1%.",
    ),
    comm_timeout: float = typer.Option(
        600.0,
        "--comm-timeout",
        help="Seconds a collective waits for the other ranks before the run stops with an error.",
    ),
    sample_prompts: Path | None = typer.Option(
        None,
        "--sample-prompts",
        help="Prompts to complete from the weights as they train (a text file, one per "
        "line, or .jsonl records with prompt or messages), greedily, all in one batch; into RUN_DIR/samples.jsonl.",
    ),
    sample_every: int | None = typer.Option(
        None,
        "--sample-every",
        help="Complete --sample-prompts every N optimizer steps (always at the end).",
    ),
    sample_max_new_tokens: int | None = typer.Option(
        None, "--sample-max-new-tokens", help="New tokens per sample prompt at most (default 64)."
    ),
    report_to: str | None = typer.Option(
        None,
        "--report-to",
        help="Experiment trackers that get the run's config and every metrics row as it is written: none (default), or any of tensorboard, wandb, mlflow, trackio, comma-separated; each needs its extra, e.g. pip install 'tierzero[wandb]'.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
) -> None:
    """Train a model; with no arguments, the `tiny` preset on the built-in corpus, tiered to NVMe.
    With --model hf:DIR, the Hugging Face causal LM in DIR, from its safetensors if it has them.

    Several ranks: `--nproc N` on one machine, or `torchrun --nproc-per-node N -m tierzero.cli
    train ...` (add torchrun's --nnodes/--rdzv-* flags for several machines)."""
    overrides = dict(
        model=model,
        units=units,
        data=data,
        text_field=text_field,
        weights=weights,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        long_examples=long_examples,
        accumulate=accumulate,
        schedule=schedule,
        recompute=recompute,
        optimizer_state=optimizer_state,
        master=master,
        lr=lr,
        weight_decay=weight_decay,
        betas=_betas(adam_betas),
        eps=adam_eps,
        warmup_steps=warmup_steps,
        clip_grad_norm=clip_grad_norm,
        clip_previous_norm=clip_previous_norm,
        seed=seed,
        dtype=dtype,
        offload=offload,
        nvme_path=nvme_path or None,
        host_budget=host_budget,
        gpu_budget=gpu_budget,
        prefetch_depth=prefetch_depth,
        overlap_step=overlap_step,
        grad_reduce_dtype=grad_reduce_dtype,
        overlap_comm=overlap_comm,
        stage=stage,
        verify_reads=verify_reads,
        quantize_base=quantize_base,
        profile=str(profile) if profile else None,
        run_dir=str(run_dir) if run_dir else None,
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
        keep_best=keep_best,
        val_data=val_data,
        val_fraction=val_fraction,
        eval_every=eval_every,
        eval_tokens=eval_tokens,
        lora_r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        lora_targets=[t.strip() for t in lora_targets.split(",") if t.strip()]
        if lora_targets
        else None,
        report_to=report_to,
        sample_prompts=str(sample_prompts) if sample_prompts else None,
        sample_every=sample_every,
        sample_max_new_tokens=sample_max_new_tokens,
        drive_tbw=drive_tbw,
    )
    if resume and overwrite:
        raise ConfigError(
            "--resume continues a run and --overwrite starts a new one; pass one of them"
        )
    check_drive_tbw(drive_tbw)
    if resume:
        config = _resume_config(run_dir, config)
        if steps is not None and config is not None and _schedule_follows_steps(config):
            overrides["total_steps"] = (
                steps  # a longer run stretches its lr schedule, as a new one would
            )
    run = _load(config, overrides)
    run.report_to = resolve_report_to(
        run.report_to
    )  # an unknown or missing tracker, before anything runs
    if resume and run_dir is not None and config == run_dir / CONFIG_NAME and nvme_path is None:
        run.engine.nvme_path = rebase_paths(
            run.engine.nvme_path, run_dir
        )  # saved relative to the run
    if not resume and not overwrite and run.run_dir is not None:
        if steps_held := [
            s for s, _ in checkpoint_dirs(run.run_dir)
        ]:  # refused before anything starts
            raise ConfigError(refuse_fresh_start(run.run_dir, steps_held))
    if run.run_dir is None and ranks_from_env().world_size > 1:
        raise ConfigError(
            "ranks started by torchrun must name one run directory; pass --run-dir DIR"
        )
    if run.run_dir is None:
        run.run_dir = str(Path("runs") / f"{_run_name(run.model)}-{time.strftime('%Y%m%d-%H%M%S')}")
    if not math.isfinite(comm_timeout) or comm_timeout <= 0:
        raise ConfigError(
            f"--comm-timeout must be a finite positive number of seconds, got {comm_timeout}"
        )
    ranks = ranks_from_env()
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    if nproc is not None and under_torchrun() and nproc != ranks.world_size:
        raise ConfigError(
            f"--nproc {nproc} was given to a rank that torchrun started as one of "
            f"{ranks.world_size}; drop --nproc when launching with torchrun"
        )
    run.check_ranks(nproc or ranks.world_size)  # once, before torchrun starts the ranks
    if nproc is not None and nproc > 1 and not under_torchrun():
        named_dir = (
            [] if run_dir is not None else ["--run-dir", run.run_dir]
        )  # every rank needs the same one
        run_torchrun(
            nproc, "tierzero.cli", ["train", *_given_args(ctx, drop={"nproc"}), *named_dir]
        )
        return
    if nvme_path is None and not _file_sets(config, "nvme_path"):
        run.engine.nvme_path = [str(Path(run.run_dir) / "nvme")]
    run.engine.device = rank_device(ranks, run.engine.device)
    die_with_launcher()
    start_process_group(ranks, run.engine.device, comm_timeout)
    try:
        _train(run, ranks, resume, overwrite, json_out)
    finally:
        stop_process_group()


def _train(run: RunConfig, ranks: Ranks, resume: bool, overwrite: bool, json_out: bool) -> None:
    """Train on this rank; only rank 0 prints, and it speaks for the run."""
    from tierzero.run.session import open_session

    out = Output(json_out, quiet=not ranks.primary)
    if (
        resume and run.engine.piece_numel is None
    ):  # its shards are keyed by it, whatever the budgets choose now
        run.engine.piece_numel = _checkpoint_piece_numel(run.run_dir)
    with (
        _open_run_dir(run, ranks, resume, overwrite) as (rundir, notes),
        open_session(run, ranks) as session,
    ):
        start_step = 0
        if resume:
            start_step, resumed = session.resume(rundir)
            notes = [*notes, *resumed]
        for note in [
            *notes,
            *session.model.notes,
            *([session.batches.note] if session.batches.note else []),
        ]:
            out.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
        if resume:  # a new run's config was written first, in `start`
            rundir.write_config(run)
        out.print(
            f"[bold]tierzero train[/] {escape(run.model)} ({session.n_params / 1e6:.2f}M params) "
            f"on {session.device}, dtype {session.dtype}, "
            f"offload {run.engine.offload.value}: {session.placement_text}"
        )
        formats = StateBytes.for_compute(
            run.engine.optimizer_state, run.engine.master, DType(session.dtype)
        )
        if formats.compact:
            out.print(f"optimizer state: {formats.describe()}", highlight=False)
        if session.fitted is not None and session.fitted.long:
            out.print(f"[yellow]note:[/] {_long_examples_text(session.fitted)}", highlight=False)
        stage = getattr(session.trainer, "stage", None)
        if ranks.world_size > 1 and stage is not None:
            out.print(
                f"ZeRO stage {stage} ({session.trainer.parts.stage_reason}): {STAGE_TEXT[stage]}",
                highlight=False,
            )
        if start_step >= run.steps:
            out.print(
                f"the run is already at step {start_step} of {run.steps}: nothing to train; raise --steps to go on"
            )
            if json_out:
                out.emit_json(
                    {"run_dir": run.run_dir, "steps": run.steps, "start_step": start_step}
                )
            return
        progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn("{task.fields[tps]:,.0f} tok/s"),
            TimeElapsedColumn(),
            console=out.console,
            disable=json_out or out.quiet,
        )
        rundir.open_metrics(start_step)
        task = progress.add_task(
            "train", total=run.steps, completed=start_step, loss=float("nan"), tps=0.0
        )
        nvme_written = [0]  # the engine's NVMe write counters, every rank's, over the steps
        process_before = process_written_bytes()

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
        for note in session.notes():
            out.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    process = process_written_bytes() if ranks.world_size == 1 else None  # this rank's process only
    process = None if process is None or process_before is None else process - process_before
    wear = DriveWear.measured(
        run.steps - start_step,
        nvme_written[0],
        process,
        _checkpoints(run, start_step, session),
        run.drive_tbw,
    )
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
        "measured_by": _MEASURED_BY[: 1 if process is None else 2],
    }
    if json_out:
        out.emit_json(summary)
    else:
        evaluated = (
            ""
            if not result.val_losses
            else f", eval loss {summary['eval_loss_start']:.4f} -> {summary['eval_loss_end']:.4f}"
        )
        out.print(
            f"loss {result.first_loss:.4f} -> {result.last_loss:.4f}{evaluated} in "
            f"{result.wall_s:.1f}s; metrics in {escape(run.run_dir)}/metrics.jsonl",
            highlight=False,
        )
        if result.best is not None:
            out.print(
                f"best checkpoint: step {result.best['step']} (eval loss {result.best['eval_loss']:.4f}), "
                f"{escape(run.run_dir)}/{result.best.get('checkpoint', '')}",
                highlight=False,
            )
        rest = (
            ""
            if process is None
            else f"; {format_bytes(wear.checkpoint_bytes)} more by checkpoints and logs (/proc/self/io)"
        )
        out.print(
            f"NVMe writes: {format_bytes(wear.step_bytes)} over {wear.steps} steps, "
            f"{format_bytes(round(wear.per_step_bytes))} per step (the engine's write counters)"
            f"{rest}",
            highlight=False,
        )
        for line in wear_lines(wear):
            out.print(line, highlight=False)


# what a run's drive wear is measured by: the steps' writes, then the process's beyond them
_MEASURED_BY = ["engine NVMe write counters (bytes_host->nvme)", "/proc/self/io write_bytes"]


def _checkpoints(run: RunConfig, start_step: int, session: Any) -> int:
    """The checkpoints this run took (a tiered run: every --checkpoint-every steps and at the end)."""
    if not hasattr(session.trainer, "save_checkpoint"):
        return 0
    every = run.checkpoint_every or run.steps
    return sum(1 for s in range(start_step + 1, run.steps + 1) if s % every == 0 or s == run.steps)


# the config keys whose flags are not spelled `--key-with-dashes`
_FLAGS = {"total_steps": "--steps", "betas": "--adam-betas", "eps": "--adam-eps"}


def _load(config: Path | None, overrides: dict[str, Any]) -> RunConfig:
    """The run's config; a refused value the user gave as a flag is named by that flag
    (`--steps`, not the `total_steps` it sets), one from --config by its key."""
    try:
        return load_run_config(config, overrides)
    except ConfigError as e:
        key = e.key
        if key is None or overrides.get(key) is None or not str(e).startswith(key):
            raise
        raise ConfigError(
            _FLAGS.get(key, "--" + key.replace("_", "-")) + str(e)[len(key) :]
        ) from None


def _long_examples_text(fitted: Fitted) -> str:
    """What --long-examples did, in one sentence."""
    done = {
        LongExamples.TRUNCATE: "truncated, keeping each prompt's end and reply's start",
        LongExamples.SPLIT: "split into windows (later ones train without their prompt)",
        LongExamples.DROP: "dropped",
    }[fitted.policy]
    return (
        f"{fitted.long} of {fitted.examples} examples are longer than --seq-len {fitted.window - 1} allows "
        f"({fitted.window} tokens with the last target): {done} (--long-examples {fitted.policy.value})"
    )


def _checkpoint_piece_numel(run_dir: str) -> int | None:
    """The piece size the run's newest checkpoint was written with (its manifest records it);
    None: no checkpoint yet, or one that predates the record. Integrity is the load's to check."""
    from tierzero.checkpoint.catalog import newest_checkpoint

    found = newest_checkpoint(run_dir, verify=False)
    value = found[1].engine.get("piece_numel") if found is not None else None
    return value if isinstance(value, int) and value > 0 else None


def _betas(text: str | None) -> tuple[float, float] | None:
    """`--adam-betas 0.9,0.95` as two floats (Config checks their range)."""
    if text is None:
        return None
    try:
        beta1, beta2 = (float(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--adam-betas '{text}' is not two numbers; write them like 0.9,0.95"
        ) from None
    return beta1, beta2


def _run_name(model: str) -> str:
    """A preset's name, or `hf-<directory name>` for hf:<dir>."""
    return f"hf-{Path(model[3:]).resolve().name}" if model.startswith("hf:") else model


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


def _given_args(ctx: typer.Context, drop: set[str]) -> list[str]:
    """The options given (those that differ from their defaults) spelled out again, for the
    ranks torchrun starts."""
    args: list[str] = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if param.name in drop or not param.opts[0].startswith("--") or value == param.default:
            continue
        if getattr(param, "is_flag", False):
            if param.secondary_opts:
                args.append(param.opts[0] if value else param.secondary_opts[0])
            elif value:
                args.append(param.opts[0])
            continue
        for item in value if getattr(param, "multiple", False) else [value]:
            args += [param.opts[0], str(item)]
    return args


def _resume_config(run_dir: Path | None, config: Path | None) -> Path | None:
    """The config a resumed run starts from: --config if given, else the run's own config.toml."""
    if run_dir is None:
        raise ConfigError(
            "--resume needs --run-dir; pass the run directory to continue with --run-dir DIR"
        )
    if not run_dir.is_dir():
        kind = kind_of(run_dir)
        raise ConfigError(
            f"run directory '{run_dir}' is {kind}, not a directory; pass the run's directory "
            "as --run-dir"
            if kind
            else f"run directory '{run_dir}' does not exist; --resume "
            "continues an existing run (drop --resume to start a new one there)"
        )
    outer = enclosing_run_dir(run_dir)
    saved = run_dir / CONFIG_NAME
    if outer is not None and not os.path.lexists(saved):
        raise ConfigError(
            f"'{run_dir}' lies inside the run directory '{outer}' (a checkpoint or its store); "
            f"resume the run with --run-dir {outer}"
        )
    if (why := not_a_file(saved)) is not None:
        raise ConfigError(
            f"{why}; restore the run's config there, or start it again with --overwrite"
        )
    if (why := never_configured(run_dir)) is not None:
        raise ConfigError(why)
    return config if config is not None or not saved.is_file() else saved


def _schedule_follows_steps(config: Path) -> bool:
    """Whether a saved run's lr schedule was derived from its --steps (not set on its own)."""
    from tierzero.configfile import read_toml

    saved = read_toml(config)
    return saved.get("total_steps") == saved.get("steps", RunConfig.steps)


def _file_sets(config: Path | None, key: str) -> bool:
    if config is None:
        return False
    from tierzero.configfile import read_toml

    return key in read_toml(config)
