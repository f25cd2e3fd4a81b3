"""`tierzero.plan(...)`: what `tierzero plan` computes, as a value for Python callers.

Owns turning a model shape (a preset, a parameter count shaped like the nearest one, or a
caller's own units) and a machine (given sizes, else `tierzero train`'s defaults for this
machine from `tierzero.planning.machine`) into a `PlanReport`: the flags checked, the shape,
the precision, the workload, every candidate placement costed and the choice
(`tierzero.planning.costing`), and the recompute choice -- the one computation the CLI prints
and `tierzero.plan` returns, so the two cannot disagree. It never prints.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierzero.config import (
    TORCH_DTYPES,
    DType,
    Evaluation,
    Recompute,
    RunConfig,
    Schedule,
    StateFormat,
    Tier,
)
from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit
from tierzero.models.llama import loss_chunk_bytes
from tierzero.models.presets import ModelArgs, get_preset
from tierzero.planning.codedbase import CodedBase
from tierzero.planning.costing import Costing
from tierzero.planning.ledger import (
    activation_memory,
    check_world_size,
    nearest_preset,
    nominal_numel,
    parse_count,
)
from tierzero.planning.machine import plan_budgets, train_dtype
from tierzero.planning.placement import candidate_placements, load_profile
from tierzero.planning.planrecords import (
    Machine,
    ModelShape,
    Precision,
    RecomputeChoice,
    RunLength,
    StageChoice,
)
from tierzero.planning.recompute import choose_kept, keepable, with_kept
from tierzero.planning.report import PlanReport
from tierzero.planning.statebytes import StateBytes, grad_dtype, grad_dtype_reason
from tierzero.planning.streaming import ladder
from tierzero.planning.wear import check_drive_tbw
from tierzero.planning.workload import Workload

DEFAULT_PRESET = "7b"

__all__ = ["DEFAULT_PRESET", "PlanReport", "make_plan"]


def make_plan(
    model: str | None = None,
    *,
    params: str | int | None = None,
    gpus: int | None = None,
    gpu_mem: str | int | None = None,
    host_mem: str | int | None = None,
    nvme_free: str | int | None = None,
    nvme_path: str | Path = ".",
    batch_size: int | None = None,
    seq_len: int | None = None,
    prefetch_depth: int | None = None,
    dtype: str | None = None,
    vocab_size: int | None = None,
    piece_numel: int | None = None,
    overlap: bool = True,
    profile: str | Path | None = None,
    stage: int | None = None,
    accumulate: int = 1,
    schedule: str = "auto",
    recompute: str = "auto",
    optimizer_state: str = "fp32",
    master: str = "fp32",
    steps: int = RunConfig.steps,
    checkpoint_every: int | None = None,
    drive_tbw: float | None = None,
    quantize_base: str = "none",
    units: Sequence[Unit] | None = None,
    args: ModelArgs | None = None,
    not_a_chain: str | None = None,
) -> PlanReport:
    """Plan `model` (a preset name, default 7b) or `params` (a count, e.g. "7e9" or
    70_000_000_000, shaped like the nearest preset) on `gpus` GPUs with the given memory sizes
    ("80GB", or bytes); a size not given is this machine's, and `dtype`, `batch_size` (per GPU)
    and `seq_len` not given are what `tierzero train` takes here by default. Arguments are
    `tierzero plan`'s flags, and the result is what it prints (`as_dict()` is its `--json`).

    `stage` forces the ZeRO stage; None chooses it as the engine does: the placement for stage
    3, then the least communication whose state fits there (`placement.choose_stage`), and
    every estimate at that stage. `piece_numel` and `prefetch_depth` of None are chosen as the
    engine chooses them (`tierzero.planning.costing`). `schedule` (horizontal, vertical or
    auto: vertical wherever it applies when accumulating) is how the `accumulate` micro-batches
    run; it applies to a built-in shape and to a built model whose units are an embedding,
    blocks and a head (a split Hugging Face decoder) unless `not_a_chain` says why the engine
    cannot drive it so (`engine.vertical.chain.chain_of`). `recompute` (auto, all or none) says
    how many blocks keep their activations in the compute device's budget the chosen placement
    leaves (`tierzero.planning.recompute`; the built-in shapes, horizontally).
    `optimizer_state` (fp32, bf16 or int8: the Adam moments) and `master` (fp32 or bf16) are
    how the optimizer's states are stored on every tier (`tierzero.planning.statebytes`).
    `gpus` given (even 1) plans GPUs computing in bf16 unless `dtype` says otherwise; not
    given, one rank computing as `tierzero train` does here. `steps`, `checkpoint_every` and
    `drive_tbw` (the drive's rated terabytes written) size the run whose NVMe writes `wear`
    projects. `quantize_base` nf4 stores a frozen base's block linear weights in NF4 on its
    home tier (`tierzero.planning.codedbase`): a built model with a frozen base (adapters
    added), one rank, params off the GPU, as `tierzero train --quantize-base nf4` takes it.
    A model built elsewhere (the CLI's hf:DIR) comes as `units`, its partition for `gpus`
    ranks, and `args`, the LLaMA-like shape its activations are estimated from; `model` then
    names it."""
    _check_counts(
        stage=stage,
        batch_size=batch_size,
        seq_len=seq_len,
        accumulate=accumulate,
        prefetch_depth=prefetch_depth,
        steps=steps,
        checkpoint_every=checkpoint_every,
        piece_numel=piece_numel,
    )
    order = _choice(Schedule, schedule, "--schedule")
    recompute_as = _choice(Recompute, recompute, "--recompute")
    not_a_chain = _not_a_chain(units, not_a_chain)
    vertical = _vertical(order, recompute_as, accumulate, not_a_chain)
    described, gpus = gpus is not None, 1 if gpus is None else gpus
    check_world_size(gpus)
    coded = _choice(_Base, quantize_base, "--quantize-base") is _Base.NF4
    if model is not None and params is not None:
        raise ConfigError("give --model or --params, not both")
    budgets, detected, device = plan_budgets(gpu_mem, host_mem, nvme_free, Path(nvme_path))
    check_drive_tbw(drive_tbw)
    precision = _precision(dtype, described, device, optimizer_state, master, accumulate, order)
    itemsize = TORCH_DTYPES[precision.dtype].itemsize
    shape = _model_shape(model, params, vocab_size, units, args)
    batch_size = batch_size if batch_size is not None else max(1, RunConfig.batch_size // gpus)
    seq_len = seq_len if seq_len is not None else RunConfig.seq_len
    activations = activation_memory(
        shape.args, batch_size, seq_len, itemsize, loss_chunk_bytes(shape.args.vocab_size)
    )
    top = ladder(piece_numel, prefetch_depth)[0]
    how: dict[str, Any] = dict(
        world_size=gpus,
        device=device,
        prefetch_depth=top.prefetch_depth,
        piece_numel=top.piece_numel,
        overlap=overlap and precision.dtype is not DType.FP16,
        stage=stage or 3,
        accumulate=accumulate,
        activations=activations,
        tokens_per_step=batch_size * activations.seq_len,
        formats=precision.formats,
        grad_itemsize=TORCH_DTYPES[precision.grad_dtype].itemsize,
        coded=_coded_base(units, gpus) if coded else None,
    )
    work = (
        Workload.from_units(units, itemsize, **how)
        if units is not None
        else Workload.from_preset(
            shape.args, itemsize, numel=shape.numel if params is not None else None, **how
        )
    )
    costing = Costing(
        candidate_placements(coded=coded),
        budgets,
        load_profile(profile) if profile is not None else None,
        piece_numel,
        prefetch_depth,
    )
    costed = costing.cost(work, stage)
    if (vertical or units is not None) and recompute_as is Recompute.NONE:
        raise ConfigError(
            "--recompute none keeps the activations the built-in model's shape counts, in the "
            "horizontal schedule only; use --recompute auto or all for this model or schedule"
        )
    candidates = [] if vertical or units is not None else work.units
    tier = Tier.HOST if device == "cpu" else Tier.GPU
    budget = budgets[tier]
    needs = costed.choice.estimate.memory.per_rank().needs()[tier]
    room = 0 if budget is None else budget - needs
    kept = with_kept(
        activations, work.units, choose_kept(recompute_as, candidates, activations, room)
    )
    return PlanReport(
        shape,
        Machine(gpus, budgets, detected, device),
        precision,
        costed.workload,
        activations,
        costed.estimates,
        costed.choice,
        StageChoice(costed.stage, costed.stage_reason),
        tuple(
            name
            for name, v in (("piece_numel", piece_numel), ("prefetch_depth", prefetch_depth))
            if v is None
        ),
        vertical,
        RecomputeChoice(recompute_as, kept, len(keepable(candidates, activations))),
        RunLength(steps, checkpoint_every, drive_tbw, Evaluation.eval_tokens),
    )


class _Base(str, enum.Enum):
    """`--quantize-base`: how a frozen base's linear weights are stored."""

    NONE = "none"
    NF4 = "nf4"


def _check_counts(*, stage: int | None, piece_numel: int | None, **counts: int | None) -> None:
    """Refuse a stage other than 1-3, a count below its least, or a piece size that is no
    positive multiple of 2048, each in one sentence naming its flag."""
    if stage is not None and stage not in (1, 2, 3):
        raise ConfigError(f"--stage must be 1, 2 or 3, got {stage}")
    least = {"prefetch_depth": 0}
    for name, value in counts.items():
        at_least = least.get(name, 1)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < at_least
        ):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be an integer >= {at_least}, got {value!r}")
    if piece_numel is not None and (
        isinstance(piece_numel, bool)
        or not isinstance(piece_numel, int)
        or piece_numel <= 0
        or piece_numel % 2048
    ):
        raise ConfigError(
            f"--piece-numel must be a positive multiple of 2048 elements, got {piece_numel!r}; "
            "e.g. 16777216 (64 MiB of fp32)"
        )


def _not_a_chain(units: Sequence[Unit] | None, why: str | None) -> str | None:
    """Why the vertical schedule cannot drive a built model (None: it can, or it is a shape)."""
    if (
        units is not None
        and why is None
        and (units[0].kind != "embedding" or units[-1].kind != "head")
    ):
        return "its units are not an embedding, blocks and a head"
    return why


def _vertical(
    schedule: Schedule, recompute: Recompute, accumulate: int, not_a_chain: str | None
) -> bool:
    """Whether the micro-batches run layer-major, as the engine chooses."""
    chain = not_a_chain is None
    if schedule is Schedule.VERTICAL and not chain:
        raise ConfigError(
            f"--schedule vertical needs a chain of units, but {not_a_chain}; "
            "use --schedule horizontal"
        )
    if schedule is Schedule.AUTO:
        return accumulate > 1 and chain and recompute is not Recompute.NONE
    return schedule is Schedule.VERTICAL


def _precision(
    dtype: str | None,
    described: bool,
    device: str,
    optimizer_state: str,
    master: str,
    accumulate: int,
    schedule: Schedule,
) -> Precision:
    """The compute dtype (given; bf16 for GPUs `described`; else train's here) and why, the
    state's formats, and the grads' dtype."""
    moments = _choice(StateFormat, optimizer_state, "--optimizer-state")
    master_dtype = _choice(DType, master, "--master")
    if master_dtype is DType.FP16:
        raise ConfigError(
            "--master 'fp16' has too few exponent bits for weights; choose fp32 or bf16"
        )
    compute = (
        _dtype(dtype) if dtype is not None else DType.BF16 if described else train_dtype(device)
    )
    source = "dtype" if dtype is not None else "gpus" if described else "train"
    grads = grad_dtype(compute, accumulate, schedule)
    return Precision(
        compute,
        source,
        StateBytes.for_compute(moments, master_dtype, compute),
        grads,
        grad_dtype_reason(compute, accumulate, schedule),
    )


def _model_shape(
    model: str | None,
    params: str | int | None,
    vocab_size: int | None,
    units: Sequence[Unit] | None,
    args: ModelArgs | None,
) -> ModelShape:
    """The shape planned: a built model's own, a parameter count shaped like the nearest
    preset, or a preset (its vocabulary changed by `vocab_size`)."""
    if vocab_size is not None and vocab_size < 1:
        raise ConfigError(f"--vocab-size must be a positive integer, got {vocab_size}")
    if units is not None:
        if args is None or params is not None or vocab_size is not None:
            raise ConfigError(
                "a built model's plan takes its own shape; drop --params and --vocab-size"
            )
        numel = sum(u.numel for u in units)
        return ModelShape(model or "model", model or "model", args, numel, numel)
    if params is not None:
        numel = parse_count(str(params), "--params")
        shape = nearest_preset(numel)
        return ModelShape(None, shape, get_preset(shape), numel, numel)
    shape = model or DEFAULT_PRESET
    args = get_preset(shape)
    if vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    numel = args.param_count()
    ledger_numel = (nominal_numel(shape) if vocab_size is None else None) or numel
    return ModelShape(shape, shape, args, numel, ledger_numel)


def _coded_base(units: Sequence[Unit] | None, gpus: int) -> CodedBase:
    """The NF4 weights of a built model's frozen base, or the refusal naming what one needs."""
    if units is None:
        raise ConfigError(
            "--quantize-base nf4 stores a frozen base's linear weights in 4 bits, and a preset "
            "shape trains every weight; plan a Hugging Face model with adapters: "
            "--model hf:DIR --lora-r 16"
        )
    if gpus > 1:
        raise ConfigError(
            "--quantize-base nf4 trains on one rank for now; drop --gpus or --quantize-base"
        )
    return CodedBase.of(units)


def _choice(cls: Any, value: str, flag: str) -> Any:
    """`value` as one of enum `cls`'s spellings, or the refusal naming `flag` and its choices."""
    try:
        return cls(str(value).lower())
    except ValueError:
        raise ConfigError(
            f"{flag} '{value}' is not valid; choose one of {'|'.join(m.value for m in cls)}"
        ) from None


def _dtype(value: str) -> DType:
    try:
        return DType(value.lower())
    except ValueError:
        raise ConfigError(f"--dtype '{value}' is not valid; choose one of bf16|fp16|fp32") from None
