"""`tierzero.plan(...)`: what `tierzero plan` computes, as a value for Python callers.

Owns turning a model shape (a preset, a parameter count shaped like the nearest one, or a
caller's own `Workload`) and a machine (given sizes, else `tierzero train`'s defaults for this
machine from `tierzero.planning.machine`) into the ledger, the activation estimate, every
candidate placement's cost and the choice -- the one computation the CLI prints and
`tierzero.plan` returns, so the two cannot disagree. The arithmetic is
`tierzero.planning.placement`'s and `tierzero.planning.memory_model`'s; this module only
assembles it. It never prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierzero.config import (
    TORCH_DTYPES,
    DType,
    Placement,
    Recompute,
    RunConfig,
    Schedule,
    StateFormat,
    StateKind,
    Tier,
)
from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit
from tierzero.models.llama import loss_chunk_bytes
from tierzero.models.presets import ModelArgs, get_preset
from tierzero.planning.homes import describe_homes
from tierzero.planning.ledger import (
    GB,
    ActivationEstimate,
    activation_memory,
    check_world_size,
    format_rows,
    ledger,
    nearest_preset,
    nominal_numel,
    parse_count,
    waiting_activations_bytes,
)
from tierzero.planning.machine import plan_budgets, train_dtype
from tierzero.planning.placement import (
    STAGE_TEXT,
    Link,
    PlacementChoice,
    PlacementEstimate,
    candidate_placements,
    choose,
    choose_stage,
    estimate,
    load_profile,
)
from tierzero.planning.recompute import choose_kept, keepable, with_kept
from tierzero.planning.statebytes import FP32_STATE, StateBytes, grad_dtype, grad_dtype_reason
from tierzero.planning.streaming import DEFAULT, Streaming, choose_streaming, ladder, streamed
from tierzero.planning.swapplan import step_nvme_bytes
from tierzero.planning.wear import (
    DriveWear,
    check_drive_tbw,
    checkpoint_nbytes,
    checkpoints_taken,
    step_nvme_written,
)
from tierzero.planning.workload import Workload

DEFAULT_PRESET = "7b"


@dataclass(frozen=True)
class PlanReport:
    """A model on a machine: its shape and units, the budgets (and which were detected), the
    activation estimate, every candidate placement's estimate, and the choice."""

    preset: str | None  # None when shaped from a parameter count
    shape: str
    args: ModelArgs
    numel: int
    ledger_numel: int  # the size the ledger table is computed from (a preset's nominal size)
    dtype: DType
    gpus: int
    budgets: dict[Tier, int | None]
    detected: list[str]
    device: str  # "cuda" | "cpu": the compute device's kind
    workload: Workload
    activations: ActivationEstimate
    estimates: list[PlacementEstimate]
    choice: PlacementChoice
    stage: int = 3  # the ZeRO stage the estimates are for (several ranks)
    stage_reason: str = "one rank"
    chosen: tuple[
        str, ...
    ] = ()  # the streaming settings left to the planner: piece_numel, prefetch_depth
    vertical: bool = False  # `--schedule`: the workload's micro-batches run layer-major (`engine.vertical.schedule`)
    recompute: Recompute = Recompute.AUTO
    kept: ActivationEstimate | None = (
        None  # `activations` counting the kept units' graphs (`planning.recompute`)
    )
    keepable_units: int = (
        0  # of which `kept.kept_blocks` blocks and the head if `kept.kept_head` keep theirs
    )
    formats: StateBytes = (
        FP32_STATE  # how the master and Adam moments are stored (`--optimizer-state`, `--master`)
    )
    dtype_source: str = (
        "dtype"  # why `dtype`: "dtype" given, "gpus" assumed, "train" train's default
    )
    steps: int = (
        RunConfig.steps
    )  # the run `wear` projects: its length, checkpoints and drive rating
    checkpoint_every: int | None = None
    drive_tbw: float | None = None
    grad_dtype: DType = DType.FP32  # grads off the device and at home (`statebytes.grad_dtype`)
    grad_reason: str = "fp32 compute"
    eval_tokens: int = RunConfig.eval_tokens  # the evaluation set `evaluation` costs

    @property
    def units(self) -> tuple[Unit, ...]:
        return self.workload.units

    @property
    def streaming(self) -> Streaming:
        """The piece size and prefetch depth the chosen placement is costed at (and the engine runs)."""
        return Streaming(self.workload.piece_numel, self.workload.prefetch_depth)

    @property
    def placement(self) -> Placement:
        """The chosen placement (the nearest miss when nothing fits: see `choice.fits`)."""
        return self.choice.placement

    def step_nvme_bytes(self) -> dict[str, int]:
        """The chosen placement's NVMe bytes (read + written) per step of `accumulate`
        micro-batches under each schedule (`swapplan.step_nvme_bytes`; params as if the host
        cache held none); vertically with the waiting activations beyond the host's room spilled."""
        w, p, e = self.workload, self.placement, self.choice.estimate
        one = e.moved_bytes[Link.NVME_TO_HOST] + e.moved_bytes[Link.HOST_TO_NVME]
        param = (
            w.world_size * w.param_numel * w.nbytes(StateKind.PARAM) if p.param is Tier.NVME else 0
        )
        grad, spilled = self._nvme_grad_bytes(), self._spilled_bytes()
        # each schedule at its own grad dtype: one pass writes the grads once and reads them once
        h, v = (self._nvme_grad_bytes(s) for s in (Schedule.HORIZONTAL, Schedule.VERTICAL))
        horizontal = step_nvme_bytes(one + 2 * (h - grad), param, h, w.accumulate, False)
        vertical = step_nvme_bytes(one + 2 * (v - grad), param, v, w.accumulate, True, spilled)
        return {"horizontal": horizontal, "vertical": vertical}

    def evaluation(self) -> dict[str, int]:
        """NVMe bytes one evaluation reads: each unit's params once per use for the whole set
        (`engine.vertical.evaluate`); window by window, once per batch of windows."""
        w, units = self.workload, self.workload.units
        uses = sum(u.param_numel for u in units) + sum(
            units[v].param_numel for u in units for v in u.uses_with
        )
        one = uses * w.nbytes(StateKind.PARAM) if self.placement.param is Tier.NVME else 0
        rows = -(-self.eval_tokens // self.activations.seq_len)
        batches = -(-rows // self.activations.batch_size)
        return {
            "windows": rows,
            "nvme_read_bytes": one,
            "per_window_nvme_read_bytes": batches * one,
        }

    def step_nvme_write_bytes(self) -> int:
        """The NVMe bytes written per step in the chosen placement and schedule, the write half
        of `step_nvme_bytes`: what wears the drive (`wear.step_nvme_written`)."""
        w, written = self.workload, self.choice.estimate.moved_bytes[Link.HOST_TO_NVME]
        return step_nvme_written(
            written,
            self._nvme_grad_bytes(),
            w.accumulate,
            self.vertical,
            self._spilled_bytes(),
            overlapped=w.overlap,
        )

    @property
    def wear(self) -> DriveWear:
        """What a run of `steps` writes to the drives (`tierzero.planning.wear`)."""
        checkpoints = checkpoints_taken(self.steps, self.checkpoint_every)
        return DriveWear(
            self.steps,
            self.steps * self.step_nvme_write_bytes(),
            checkpoints * checkpoint_nbytes(self.workload, self.placement),
            checkpoints,
            self.drive_tbw,
        )

    def _nvme_grad_bytes(self, schedule: Schedule | None = None) -> int:
        """Every rank's NVMe-homed grads: what each further horizontal micro-batch reads and writes
        (in the grad dtype planned, or the one `schedule` would store them in)."""
        w = self.workload
        itemsize = (
            w.nbytes(StateKind.GRAD)
            if schedule is None
            else TORCH_DTYPES[grad_dtype(self.dtype, w.accumulate, schedule)].itemsize
        )
        on_nvme = self.placement.grad is Tier.NVME
        return w.world_size * w.state_shard_numel * itemsize if on_nvme else 0

    def _spilled_bytes(self) -> int:
        """The vertical schedule's waiting activations beyond the host's room (spilled to NVMe)."""
        w, e = self.workload, self.choice.estimate
        waiting = self.gpus * waiting_activations_bytes(
            self.args.n_layers,
            self.args.dim,
            self.args.vocab_size,
            self.args.tie_embeddings,
            self.activations.batch_size * self.activations.seq_len,
            w.accumulate,
            w.compute_itemsize,
        )
        host = self.budgets[Tier.HOST]
        return 0 if host is None else max(0, waiting - max(0, host - e.memory.needs()[Tier.HOST]))

    def as_dict(self) -> dict[str, Any]:
        """The JSON object `tierzero plan --json` prints."""
        act, itemsize = self.activations, TORCH_DTYPES[self.dtype].itemsize
        return {
            "model": {
                "preset": self.preset,
                "shape": self.shape,
                "params": self.numel,
                "ledger_params": self.ledger_numel,
                "units": len(self.units),
                "largest_unit_params": self.workload.largest_unit_numel,
                "vocab_size": self.args.vocab_size,
            },
            "machine": {
                "gpus": self.gpus,
                "detected": self.detected,
                "device": self.device,
                **{f"{t.value}_budget_bytes": b for t, b in self.budgets.items()},
            },
            "dtype": self.dtype.value,
            "dtype_source": self.dtype_source,
            "drive_wear": self.wear.as_dict(),
            "state_formats": {
                "optimizer_state": self.formats.optimizer_state.value,
                "master": self.formats.master.value,
                "one_weight": self.formats.one_weight,
                "text": self.formats.describe(),
                "grad": self.grad_dtype.value,
                "grad_reason": self.grad_reason,
            },
            "homes": self.homes(),
            "ledger": [
                {
                    "stage": r.stage.value,
                    "bytes_per_param": r.bytes_per_param,
                    "gb_per_gpu": round(r.bytes_per_gpu / GB, 4),
                    "exact_gb_per_gpu": round(r.bytes_per_param * self.numel / GB, 4),
                }
                for r in ledger(self.ledger_numel, self.gpus, itemsize, self.formats)
            ],
            "compact_ledger": [
                {
                    "optimizer_state": f.formats.optimizer_state.value,
                    "master": f.formats.master.value,
                    "weights": f.weights,
                    "grads": f.grads,
                    "moments": f.moments,
                    "bytes_per_param": f.total,
                    "chosen": f.formats == self.formats,
                }
                for f in format_rows(self.dtype)
            ],
            "activations": {
                "batch_size": act.batch_size,
                "seq_len": act.seq_len,
                "checkpoints_bytes": act.checkpoints_bytes,
                "block_backward_bytes": act.block_backward_bytes,
                "head_backward_bytes": act.head_backward_bytes,
                "logits_bytes": act.logits_bytes,
                "chunk_tokens": act.chunk_tokens,
                "forward_bytes": act.forward_bytes,
                "backward_bytes": act.backward_bytes,
                "total_bytes": act.total_bytes,
            },
            "placements": [
                {**e.as_dict(), "fits": not e.overflow_bytes(self.budgets)} for e in self.estimates
            ],
            "verdict": {
                **self.choice.as_dict(),
                "breakdown": self.choice.estimate.memory.breakdown(),
            },
            "per_rank": self.per_rank(),
            "stage": {
                "stage": self.stage,
                "reason": self.stage_reason,
                "text": STAGE_TEXT[self.stage],
            },
            "evaluation": self.evaluation(),
            "schedule": {
                "schedule": "vertical" if self.vertical else "horizontal",
                "accumulate": self.workload.accumulate,
                "nvme_bytes_per_step": self.step_nvme_bytes(),
            },
            "recompute": {
                "recompute": self.recompute.value,
                "keepable_units": self.keepable_units,
                "kept_blocks": self.kept.kept_blocks if self.kept else 0,
                "kept_head": self.kept.kept_head if self.kept else False,
                "bytes_per_block": act.recompute_bytes,
                "head_bytes": act.head_kept_bytes,
                "kept_bytes": self.kept.kept_bytes if self.kept else 0,
            },
            "streaming": {
                "piece_numel": self.streaming.piece_numel,
                "prefetch_depth": self.streaming.prefetch_depth,
                "default": self.streaming == DEFAULT,
                "chosen": list(self.chosen),
            },
        }

    def homes(self) -> dict[str, Any]:
        """What each tier holds under the chosen placement, per state kind in its stored dtype."""
        w, p = self.workload, self.placement
        grads = f"grads {self.grad_dtype.value}: {self.grad_reason}"
        text = f"{describe_homes(w, p, self.dtype)} ({grads})"
        return {"kinds": {k.value: p.home(k).value for k in StateKind}, "text": text}

    def per_rank(self) -> dict[str, Any]:
        """One rank's share of the chosen placement: what its pools and `tierzero train` budgets
        hold (train's default host budget is the machine's, split evenly across its ranks)."""
        mine = self.choice.estimate.memory.per_rank()
        host = self.budgets[Tier.HOST]
        return {
            "ranks": self.gpus,
            "peak_bytes": {t.value: n for t, n in mine.needs().items()},
            "pool_bytes": {t.value: mine.tiers[t].pool_bytes for t in (Tier.GPU, Tier.HOST)},
            "host_budget_bytes": None if host is None else host // self.gpus,
            "breakdown": mine.breakdown(),
        }


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
    units: Sequence[Unit] | None = None,
    args: ModelArgs | None = None,
    not_a_chain: str | None = None,
) -> PlanReport:
    """Plan `model` (a preset name, default 7b) or `params` (a count, e.g. "7e9" or 70_000_000_000,
    shaped like the nearest preset) on `gpus` GPUs with the given memory sizes ("80GB", or
    bytes); a size not given is this machine's, and `dtype`, `batch_size` (per GPU) and `seq_len`
    not given are what `tierzero train` takes here by default. Arguments are `tierzero plan`'s flags, and
    the result is what it prints (`as_dict()` is its `--json`). `stage` forces the ZeRO stage;
    None chooses it as the engine does: the placement for stage 3, then the least communication
    whose state fits there (`tierzero.planning.placement.choose_stage`), and every estimate at that stage.
    `piece_numel` and `prefetch_depth` of None are chosen as the engine chooses them
    (`tierzero.planning.streaming`): the defaults, unless no placement fits stage 3 with them;
    then per placement the largest that fit, a placement that fits at none costed at the
    defaults (the engine refuses it at the ladder's least, with that figure).
    `schedule` (horizontal, vertical or auto: vertical wherever it applies when accumulating)
    is how the `accumulate` micro-batches run; it applies to a built-in shape and to a built
    model whose units are an embedding, blocks and a head (a split Hugging Face decoder) unless
    `not_a_chain` says why the engine cannot drive it so (`tierzero.engine.vertical.chain.chain_of`).
    `recompute` (auto, all or none) says how many blocks keep their activations in the compute
    device's budget the chosen placement leaves (the engine's choice, `tierzero.planning.recompute`;
    the built-in shapes, horizontally).
    `optimizer_state` (fp32, bf16 or int8: the Adam moments) and `master` (fp32 or bf16) are
    how the optimizer's states are stored on every tier (`tierzero.planning.statebytes`): the
    ledger, every tier's bytes, the traffic and so the choice count them so.
    `gpus` given (even 1) plans GPUs computing in bf16 unless `dtype` says otherwise; not given,
    one rank computing as `tierzero train` does here. `steps`, `checkpoint_every` and
    `drive_tbw` (the drive's rated terabytes written) size the run whose NVMe writes `wear` projects.
    A model built elsewhere (the CLI's hf:DIR) comes as `units`, its partition for `gpus` ranks,
    and `args`, the LLaMA-like shape its activations are estimated from; `model` then names it."""
    if stage is not None and stage not in (1, 2, 3):
        raise ConfigError(f"--stage must be 1, 2 or 3, got {stage}")
    for flag, value, least in (
        ("--batch-size", batch_size, 1),
        ("--seq-len", seq_len, 1),
        ("--accumulate", accumulate, 1),
        ("--prefetch-depth", prefetch_depth, 0),
        ("--steps", steps, 1),
        ("--checkpoint-every", checkpoint_every, 1),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < least
        ):
            raise ConfigError(f"{flag} must be an integer >= {least}, got {value!r}")
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
    try:
        schedule = Schedule(schedule)
    except ValueError:
        raise ConfigError(
            f"--schedule '{schedule}' is not valid; choose one of horizontal|vertical|auto"
        ) from None
    if (
        units is not None
        and not_a_chain is None
        and (units[0].kind != "embedding" or units[-1].kind != "head")
    ):
        not_a_chain = "its units are not an embedding, blocks and a head"
    chain = not_a_chain is None
    if schedule is Schedule.VERTICAL and not chain:
        raise ConfigError(
            f"--schedule vertical needs a chain of units, but {not_a_chain}; use --schedule horizontal"
        )
    vertical = schedule is Schedule.VERTICAL or (
        schedule is Schedule.AUTO and accumulate > 1 and chain
    )
    try:
        recompute = Recompute(recompute)
    except ValueError:
        raise ConfigError(
            f"--recompute '{recompute}' is not valid; choose one of auto|all|none"
        ) from None
    vertical = vertical and not (
        schedule is Schedule.AUTO and recompute is Recompute.NONE
    )  # as the engine chooses
    described, gpus = gpus is not None, 1 if gpus is None else gpus
    check_world_size(gpus)
    moments, master_dtype = (
        _choice(StateFormat, optimizer_state, "--optimizer-state"),
        _choice(DType, master, "--master"),
    )
    if master_dtype is DType.FP16:
        raise ConfigError(
            "--master 'fp16' has too few exponent bits for weights; choose fp32 or bf16"
        )
    if vocab_size is not None and vocab_size < 1:
        raise ConfigError(f"--vocab-size must be a positive integer, got {vocab_size}")
    if model is not None and params is not None:
        raise ConfigError("give --model or --params, not both")
    budgets, detected, device = plan_budgets(gpu_mem, host_mem, nvme_free, Path(nvme_path))
    check_drive_tbw(drive_tbw)
    compute = (
        _dtype(dtype) if dtype is not None else DType.BF16 if described else train_dtype(device)
    )
    dtype_source = "dtype" if dtype is not None else "gpus" if described else "train"
    itemsize = TORCH_DTYPES[compute].itemsize
    formats = StateBytes.for_compute(moments, master_dtype, compute)
    batch_size = batch_size if batch_size is not None else max(1, RunConfig.batch_size // gpus)
    seq_len = seq_len if seq_len is not None else RunConfig.seq_len
    if units is not None:
        if args is None or params is not None or vocab_size is not None:
            raise ConfigError(
                "a built model's plan takes its own shape; drop --params and --vocab-size"
            )
        shape, numel = model or "model", sum(u.numel for u in units)
        ledger_numel = numel
    elif params is not None:
        numel = parse_count(str(params), "--params")
        shape, ledger_numel = nearest_preset(numel), numel
        args = get_preset(shape)
    else:
        shape = model or DEFAULT_PRESET
        args = get_preset(shape)
        if vocab_size is not None:
            args = dataclasses.replace(args, vocab_size=vocab_size)
        numel = args.param_count()
        ledger_numel = (nominal_numel(shape) if vocab_size is None else None) or numel
    assert args is not None
    activations = activation_memory(
        args, batch_size, seq_len, itemsize, loss_chunk_bytes(args.vocab_size)
    )
    # grads leave the device and rest in the dtype the engine plans (the ledger: the textbook 16 B)
    grads = grad_dtype(compute, accumulate, schedule)
    top = ladder(piece_numel, prefetch_depth)[0]
    how: dict[str, Any] = dict(
        world_size=gpus,
        device=device,
        prefetch_depth=top.prefetch_depth,
        piece_numel=top.piece_numel,
        overlap=overlap and compute is not DType.FP16,
        stage=stage or 3,
        accumulate=accumulate,
        activations=activations,
        tokens_per_step=batch_size * activations.seq_len,
        formats=formats,
        grad_itemsize=TORCH_DTYPES[grads].itemsize,
    )
    work = (
        Workload.from_units(units, itemsize, **how)
        if units is not None
        else Workload.from_preset(
            args, itemsize, numel=numel if params is not None else None, **how
        )
    )
    prof = load_profile(profile) if profile is not None else None

    at_defaults = [estimate(p, work, prof) for p in candidate_placements()]
    # as the engine: the ladder only where nothing fits stage 3 at the defaults, so budgets the
    # defaults fit keep every choice they made before
    at_stage3 = (
        at_defaults
        if work.stage == 3
        else [estimate(p, dataclasses.replace(work, stage=3)) for p in candidate_placements()]
    )
    walk = None in (piece_numel, prefetch_depth) and all(
        e.overflow_bytes(budgets) for e in at_stage3
    )

    def fitted(p: Placement, w: Workload) -> Workload:
        """`w` streaming as the engine would run it at `p`: when walking, the first rung that
        fits (the settings given kept), else (or where none does) `w`'s own."""
        fit = (
            choose_streaming(w, p, budgets, piece_numel=piece_numel, prefetch_depth=prefetch_depth)
            if walk
            else None
        )
        return streamed(w, fit) if isinstance(fit, Streaming) else w

    def cost_all(
        w: Workload, known: Sequence[PlacementEstimate] = ()
    ) -> tuple[list[PlacementEstimate], dict[Placement, Workload]]:
        """Every placement's estimate as `fitted` streams it (`known`: those at `w` itself)."""
        works = {p: fitted(p, w) for p in candidate_placements()}
        at_w = {e.placement: e for e in known}
        return [
            at_w[p] if pw is w and p in at_w else estimate(p, pw, prof) for p, pw in works.items()
        ], works

    estimates, works = (
        cost_all(work, at_defaults)
        if walk
        else (at_defaults, {e.placement: work for e in at_defaults})
    )
    choice = choose(estimates, budgets)
    chosen, reason = choose_stage(
        lambda s: (
            not estimate(
                choice.placement, fitted(choice.placement, dataclasses.replace(work, stage=s))
            ).overflow_bytes(budgets)
        ),
        gpus,
        accumulate,
        stage,
    )
    if (
        chosen != work.stage
    ):  # the engine keeps the placement and replicates: cost every one at that stage
        estimates, works = cost_all(dataclasses.replace(work, stage=chosen))
        mine = next(e for e in estimates if e.placement == choice.placement)
        choice = PlacementChoice(mine, fits=True)
    if (vertical or units is not None) and recompute is Recompute.NONE:
        raise ConfigError(
            "--recompute none keeps the activations the built-in model's shape counts, in the "
            "horizontal schedule only; use --recompute auto or all for this model or schedule"
        )
    candidates = [] if vertical or units is not None else work.units
    tier = Tier.HOST if device == "cpu" else Tier.GPU
    budget = budgets[tier]
    room = 0 if budget is None else budget - choice.estimate.memory.per_rank().needs()[tier]
    kept = with_kept(activations, work.units, choose_kept(recompute, candidates, activations, room))
    return PlanReport(
        None if params is not None else shape,
        shape,
        args,
        numel,
        ledger_numel,
        compute,
        gpus,
        budgets,
        detected,
        device,
        works[choice.placement],
        activations,
        estimates,
        choice,
        chosen,
        reason,
        tuple(
            name
            for name, v in (("piece_numel", piece_numel), ("prefetch_depth", prefetch_depth))
            if v is None
        ),
        vertical,
        recompute,
        kept,
        len(keepable(candidates, activations)),
        formats,
        dtype_source,
        steps,
        checkpoint_every,
        drive_tbw,
        grad_dtype=grads,
        grad_reason=grad_dtype_reason(compute, accumulate, schedule),
    )


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
