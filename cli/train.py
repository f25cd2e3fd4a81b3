"""`tierzero train`: train a built-in model on built-in or given data, in memory or tiered.

The command settles the run's config (options over --config, or over the run's own config.toml
on --resume), refuses what cannot run before anything starts, starts --nproc ranks with torchrun's
launcher, and trains on this rank (`tierzero.cli.train_session`)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from tierzero.cli import train_options as opt
from tierzero.cli.train_session import train_on_rank
from tierzero.storage.filekind import kind_of, not_a_file

from tierzero.checkpoint.catalog import checkpoint_dirs
from tierzero.config import RunConfig
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
from tierzero.planning.wear import check_drive_tbw
from tierzero.run.directory import (
    CONFIG_NAME,
    enclosing_run_dir,
    never_configured,
    rebase_paths,
    refuse_fresh_start,
)
from tierzero.run.trackers import resolve_report_to


def train(
    ctx: typer.Context,
    config: opt.Config = None,
    model: opt.Model = None,
    units: opt.Units = None,
    data: opt.Data = None,
    text_field: opt.TextField = None,
    weights: opt.Weights = None,
    lora_r: opt.LoraR = None,
    lora_alpha: opt.LoraAlpha = None,
    lora_dropout: opt.LoraDropout = None,
    lora_targets: opt.LoraTargets = None,
    steps: opt.Steps = None,
    batch_size: opt.BatchSize = None,
    seq_len: opt.SeqLen = None,
    long_examples: opt.LongExamples = None,
    accumulate: opt.Accumulate = None,
    schedule: opt.Schedule = None,
    recompute: opt.Recompute = None,
    optimizer_device: opt.OptimizerDevice = None,
    optimizer_state: opt.OptimizerState = None,
    master: opt.Master = None,
    lr: opt.Lr = None,
    weight_decay: opt.WeightDecay = None,
    adam_betas: opt.AdamBetas = None,
    adam_eps: opt.AdamEps = None,
    warmup_steps: opt.WarmupSteps = None,
    clip_grad_norm: opt.ClipGradNorm = None,
    clip_previous_norm: opt.ClipPreviousNorm = None,
    seed: opt.Seed = None,
    dtype: opt.Dtype = None,
    offload: opt.Offload = None,
    nvme_path: opt.NvmePath = None,
    host_budget: opt.HostBudget = None,
    gpu_budget: opt.GpuBudget = None,
    prefetch_depth: opt.PrefetchDepth = None,
    overlap_step: opt.OverlapStep = None,
    quantize_base: opt.QuantizeBase = None,
    verify_reads: opt.VerifyReads = None,
    profile: opt.Profile = None,
    run_dir: opt.RunDir = None,
    checkpoint_every: opt.CheckpointEvery = None,
    keep_checkpoints: opt.KeepCheckpoints = None,
    keep_best: opt.KeepBest = None,
    val_data: opt.ValData = None,
    val_fraction: opt.ValFraction = None,
    eval_every: opt.EvalEvery = None,
    eval_tokens: opt.EvalTokens = None,
    resume: opt.Resume = False,
    overwrite: opt.Overwrite = False,
    grad_reduce_dtype: opt.GradReduceDtype = None,
    overlap_comm: opt.OverlapComm = None,
    stage: opt.Stage = None,
    nproc: opt.Nproc = None,
    drive_tbw: opt.DriveTbw = None,
    comm_timeout: opt.CommTimeout = 600.0,
    sample_prompts: opt.SamplePrompts = None,
    sample_every: opt.SampleEvery = None,
    sample_max_new_tokens: opt.SampleMaxNewTokens = None,
    report_to: opt.ReportTo = None,
    json_out: opt.JsonOut = False,
) -> None:
    """Train a model; with no arguments, the `tiny` preset on the built-in corpus, tiered to NVMe.
    With --model hf:DIR, the Hugging Face causal LM in DIR, from its safetensors if it has them.

    Several ranks: `--nproc N` on one machine, or `torchrun --nproc-per-node N -m tierzero.cli
    train ...` (add torchrun's --nnodes/--rdzv-* flags for several machines)."""
    run = _run_config(config, opt.run_overrides(ctx.params), run_dir, resume, overwrite)
    ranks = _this_rank(run, nproc, comm_timeout)
    if nproc is not None and nproc > 1 and not under_torchrun():
        _start_ranks(ctx, run, nproc, named=run_dir is not None)
        return
    run = run.replace(device=rank_device(ranks, run.engine.tiering.device))
    with _process_group(run, ranks, comm_timeout):
        train_on_rank(run, ranks, resume, overwrite, json_out)


def _run_config(
    config: Path | None,
    overrides: dict[str, Any],
    run_dir: Path | None,
    resume: bool,
    overwrite: bool,
) -> RunConfig:
    """The run's config: --config (on --resume, by default the run's own config.toml) under the
    options given, its trackers checked, its run directory named and its NVMe paths settled."""
    if resume and overwrite:
        raise ConfigError(
            "--resume continues a run and --overwrite starts a new one; pass one of them"
        )
    check_drive_tbw(overrides["drive_tbw"])
    if resume:
        config = _resume_config(run_dir, config)
        steps = overrides["steps"]
        if steps is not None and config is not None and _schedule_follows_steps(config):
            # a longer run stretches its lr schedule, as a new one would
            overrides["total_steps"] = steps
    run = _load(config, overrides)
    # an unknown or missing tracker, before anything runs
    run = run.replace(report_to=resolve_report_to(run.reporting.report_to))
    nvme_given = overrides["nvme_path"] is not None
    if resume and run_dir is not None and config == run_dir / CONFIG_NAME and not nvme_given:
        # saved relative to the run
        run = run.replace(nvme_path=rebase_paths(run.engine.tiering.nvme_path, run_dir))
    run = run.replace(run_dir=_run_dir(run, resume, overwrite))
    if not nvme_given and not _file_sets(config, "nvme_path"):
        run = run.replace(nvme_path=[str(Path(run.run_dir) / "nvme")])
    return run


def _run_dir(run: RunConfig, resume: bool, overwrite: bool) -> str:
    """The run's directory: the one named, unless a new run would start over its checkpoints, or
    a new one under runs/ (not for ranks torchrun started: each would name its own)."""
    if run.run_dir is not None:
        held = [] if resume or overwrite else [s for s, _ in checkpoint_dirs(run.run_dir)]
        if held:
            raise ConfigError(refuse_fresh_start(run.run_dir, held))
        return run.run_dir
    if ranks_from_env().world_size > 1:
        raise ConfigError(
            "ranks started by torchrun must name one run directory; pass --run-dir DIR"
        )
    return str(Path("runs") / f"{_run_name(run.model)}-{time.strftime('%Y%m%d-%H%M%S')}")


def _this_rank(run: RunConfig, nproc: int | None, comm_timeout: float) -> Ranks:
    """This process's rank among those torchrun started (or the only one), once the ranks
    asked for are known to be able to train the run."""
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
    return ranks


def _start_ranks(ctx: typer.Context, run: RunConfig, nproc: int, named: bool) -> None:
    """Start `nproc` ranks with torchrun's launcher, each given the options given here and the
    same run directory (the one this process named, when none was `named`)."""
    run_dir = [] if named else ["--run-dir", run.run_dir]
    run_torchrun(nproc, "tierzero.cli", ["train", *_given_args(ctx, drop={"nproc"}), *run_dir])


@contextmanager
def _process_group(run: RunConfig, ranks: Ranks, comm_timeout: float) -> Iterator[None]:
    """This rank on its device in the ranks' process group, left when training ends or fails; a
    rank dies with its launcher."""
    die_with_launcher()
    start_process_group(ranks, run.engine.tiering.device, comm_timeout)
    try:
        yield
    finally:
        stop_process_group()


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


def _run_name(model: str) -> str:
    """A preset's name, or `hf-<directory name>` for hf:<dir>."""
    return f"hf-{Path(model[3:]).resolve().name}" if model.startswith("hf:") else model


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
