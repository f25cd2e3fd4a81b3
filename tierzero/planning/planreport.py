"""`tierzero.plan(...)`: what `tierzero plan` computes, as a value for Python callers.

Owns turning a model shape (a preset, a parameter count shaped like the nearest one, or a
caller's own units) and a machine (given sizes, else `tierzero train`'s defaults for this
machine from `tierzero.planning.machine`) into a `PlanReport` -- the one computation the CLI
prints and `tierzero.plan` returns, so the two cannot disagree. It never prints.

Every choice left open is made as `tierzero train` makes it here: the compute dtype (bf16 for
GPUs named, else train's default on this device), the batch (train's, split over the GPUs),
the schedule (vertical when accumulating, where the engine can drive it: a built-in shape or a
split Hugging Face decoder, and not with `--recompute none`), the streaming settings and the
ZeRO stage (`tierzero.planning.costing`), and the blocks that keep their activations in the
room the chosen placement leaves on the compute device (`tierzero.planning.recompute`; the
built-in shapes, horizontally). The state's formats count in the ledger, every tier's bytes,
the traffic and so the choice (`tierzero.planning.statebytes`); an NF4 base's stored bytes too
(`tierzero.planning.codedbase`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierzero.config import (
    TORCH_DTYPES,
    DType,
    OptimizerDevice,
    Recompute,
    RunConfig,
    Schedule,
    Tier,
)
from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit
from tierzero.models.llama import loss_chunk_bytes
from tierzero.models.presets import get_preset
from tierzero.planning.codedbase import CodedBase
from tierzero.planning.costing import Costed, Costing
from tierzero.planning.ledger import activation_memory, nearest_preset, nominal_numel, parse_count
from tierzero.planning.machine import plan_budgets, train_dtype
from tierzero.planning.placement import candidate_placements, load_profile
from tierzero.planning.planflags import (
    BaseFormat,
    FormatFlags,
    MachineFlags,
    PlanFlags,
    ShapeFlags,
    StepFlags,
)
from tierzero.planning.planrecords import (
    Machine,
    ModelShape,
    Precision,
    RecomputeChoice,
    StageChoice,
)
from tierzero.planning.recompute import choose_kept, keepable, with_kept
from tierzero.planning.report import PlanReport
from tierzero.planning.statebytes import StateBytes, grad_dtype, grad_dtype_reason
from tierzero.planning.stepdevice import NO_ROOM, StepRates, choose, measured_rates
from tierzero.planning.streaming import ladder
from tierzero.planning.workload import Workload

DEFAULT_PRESET = "7b"


def make_plan(model: str | None = None, **flags: Any) -> PlanReport:
    """Plan `model` (a preset name, default 7b; or the name of a model built elsewhere, given
    as its `units`) on a machine. `flags` are `tierzero plan`'s, by name
    (`tierzero.planning.planflags`: e.g. `params="70B"`, `gpus=8`, `host_mem="512GB"`,
    `accumulate=4`, `quantize_base="nf4"`); the result is what it prints (`as_dict()` is its
    `--json`)."""
    f = PlanFlags(**flags)
    step = f.step
    if model is not None and f.shape.params is not None:
        raise ConfigError("give --model or --params, not both")
    vertical = _vertical(step, f.shape.not_a_chain)
    machine = _machine(f.machine)
    precision = _precision(f.formats, f.described, machine.device, step)
    shape = _model_shape(model, f.shape)
    coded = (
        _coded_base(f.shape.units, machine.gpus)
        if f.formats.quantize_base is BaseFormat.NF4
        else None
    )
    work = _workload(shape, precision, step, machine, f.shape, coded)
    profile = load_profile(f.machine.profile) if f.machine.profile is not None else None
    costing = Costing(
        candidate_placements(coded=coded is not None),
        machine.budgets,
        profile,
        step.piece_numel,
        step.prefetch_depth,
    )
    costed, optimizer = _step_side(costing, costing.cost(work, step.stage), step, machine)
    built = f.shape.units is not None
    return PlanReport(
        shape,
        machine,
        precision,
        costed.workload,
        work.activations,
        costed.estimates,
        costed.choice,
        StageChoice(costed.stage, costed.stage_reason),
        step.left_open,
        vertical,
        _recompute_choice(step, vertical, built, costed, machine, work),
        f.run,
        optimizer,
    )


def _step_side(
    costing: Costing, costed: Costed, step: StepFlags, machine: Machine
) -> tuple[Costed, str]:
    """Where the chosen placement's optimizer steps (`planning.stepdevice`), and why; stepped
    on the device, the placement costed so (its pool holds the optimizer's pieces), and under
    `auto` the host kept where that does not fit. `auto` weighs the sides by the profile's
    host<->device rate (else this machine's, where it has a GPU) and this CPU's step."""
    work, profile = costed.workload, costing.profile
    placement = costed.choice.placement

    def rates() -> StepRates | None:
        if profile is None:
            return measured_rates(work.formats)
        fused = None if work.formats.compact else profile.adam_params_per_s
        return measured_rates(work.formats, profile.h2d_pinned_gbps, fused)

    itemsizes = (work.compute_itemsize, work.grad_itemsize)
    c = step.optimizer_device
    chosen, why = choose(placement, c, machine.device, work.formats, itemsizes, work.overlap, rates)
    if chosen == placement:
        return costed, why
    recosted = dataclasses.replace(costing, candidates=[chosen]).cost(work, costed.stage)
    if c is OptimizerDevice.AUTO and not recosted.choice.fits:
        return costed, NO_ROOM
    return recosted, why


def _vertical(step: StepFlags, not_a_chain: str | None) -> bool:
    """Whether the micro-batches run layer-major, as the engine chooses."""
    chain = not_a_chain is None
    if step.schedule is Schedule.VERTICAL and not chain:
        raise ConfigError(
            f"--schedule vertical needs a chain of units, but {not_a_chain}; "
            "use --schedule horizontal"
        )
    if step.schedule is Schedule.AUTO:
        return step.accumulate > 1 and chain and step.recompute is not Recompute.NONE
    return step.schedule is Schedule.VERTICAL


def _machine(flags: MachineFlags) -> Machine:
    """The ranks and each tier's budget: given, else this machine's (and which were found)."""
    budgets, detected, device = plan_budgets(
        flags.gpu_mem, flags.host_mem, flags.nvme_free, Path(flags.nvme_path)
    )
    return Machine(1 if flags.gpus is None else flags.gpus, budgets, detected, device)


def _precision(flags: FormatFlags, described: bool, device: str, step: StepFlags) -> Precision:
    """The compute dtype (given; bf16 for GPUs `described`; else train's here) and why, the
    state's formats, and the grads' dtype."""
    compute = (
        flags.dtype if flags.dtype is not None else DType.BF16 if described else train_dtype(device)
    )
    source = "dtype" if flags.dtype is not None else "gpus" if described else "train"
    formats = StateBytes.for_compute(flags.optimizer_state, flags.master, compute)
    return Precision(
        compute,
        source,
        formats,
        grad_dtype(compute, step.accumulate, step.schedule),
        grad_dtype_reason(compute, step.accumulate, step.schedule),
    )


def _model_shape(model: str | None, flags: ShapeFlags) -> ModelShape:
    """The shape planned: a built model's own, a parameter count shaped like the nearest
    preset, or a preset (its vocabulary changed by `vocab_size`)."""
    if flags.units is not None:
        assert flags.args is not None  # `ShapeFlags` refuses units without it
        numel = sum(u.numel for u in flags.units)
        return ModelShape(model or "model", model or "model", flags.args, numel, numel)
    if flags.params is not None:
        numel = parse_count(str(flags.params), "--params")
        shape = nearest_preset(numel)
        return ModelShape(None, shape, get_preset(shape), numel, numel)
    shape = model or DEFAULT_PRESET
    args = get_preset(shape)
    if flags.vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=flags.vocab_size)
    numel = args.param_count()
    ledger_numel = (nominal_numel(shape) if flags.vocab_size is None else None) or numel
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


def _workload(
    shape: ModelShape,
    precision: Precision,
    step: StepFlags,
    machine: Machine,
    flags: ShapeFlags,
    coded: CodedBase | None,
) -> Workload:
    """The units and how one rank steps them, at the streaming ladder's top (the defaults, or
    the settings given), with the activation estimate of the batch."""
    gpus, itemsize = machine.gpus, TORCH_DTYPES[precision.dtype].itemsize
    batch_size = step.batch_size or max(1, RunConfig.batch_size // gpus)
    chunk = loss_chunk_bytes(shape.args.vocab_size)
    activations = activation_memory(
        shape.args, batch_size, step.seq_len or RunConfig.seq_len, itemsize, chunk
    )
    top = ladder(step.piece_numel, step.prefetch_depth)[0]
    how: dict[str, Any] = dict(
        world_size=gpus,
        device=machine.device,
        prefetch_depth=top.prefetch_depth,
        piece_numel=top.piece_numel,
        overlap=step.overlap and precision.dtype is not DType.FP16,
        stage=step.stage or 3,
        accumulate=step.accumulate,
        activations=activations,
        tokens_per_step=batch_size * activations.seq_len,
        formats=precision.formats,
        grad_itemsize=TORCH_DTYPES[precision.grad_dtype].itemsize,
        coded=coded,
    )
    if flags.units is not None:
        return Workload.from_units(flags.units, itemsize, **how)
    numel = shape.numel if flags.params is not None else None
    return Workload.from_preset(shape.args, itemsize, numel=numel, **how)


def _recompute_choice(
    step: StepFlags, vertical: bool, built: bool, costed: Costed, machine: Machine, work: Workload
) -> RecomputeChoice:
    """The units that keep their activations in the compute device's room the chosen
    placement leaves: vertically each kept block holds a graph per micro-batch; a `built` model's
    graphs are estimated from its LLaMA-like shape here (the engine measures them)."""
    if (vertical or built) and step.recompute is Recompute.NONE:
        raise ConfigError(
            "--recompute none keeps the activations the built-in model's shape counts, in the "
            "horizontal schedule only; use --recompute auto or all for this model or schedule"
        )
    tier = Tier.HOST if machine.device == "cpu" else Tier.GPU
    budget = machine.budgets[tier]
    needs = costed.choice.estimate.memory.per_rank().needs()[tier]
    room = 0 if budget is None else budget - needs
    act = work.activations
    assert act is not None
    if vertical:
        act = dataclasses.replace(act, vertical=step.accumulate)
    kept = with_kept(act, work.units, choose_kept(step.recompute, work.units, act, room))
    return RecomputeChoice(step.recompute, kept, len(keepable(work.units, act)), built)
