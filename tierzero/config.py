"""Configuration: the engine's `Config`, the run's `RunConfig`, placements, TOML loading.

Every field is validated here with a message that names the field and the fix, so nothing
downstream needs to re-check user input. This module does no I/O beyond reading a TOML file.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierzero.errors import ConfigError
from tierzero.refusals import count as _count
from tierzero.refusals import number as _number
from tierzero.refusals import positive as _positive
from tierzero.refusals import refused as _refused
from tierzero.refusals import whole as _whole


class Tier(str, enum.Enum):
    GPU = "gpu"
    HOST = "host"
    NVME = "nvme"


class StateKind(str, enum.Enum):
    PARAM = "param"
    GRAD = "grad"
    MASTER = "master"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"


# the optimizer's states: what AdamW steps besides the param, always homed together by the planner
OPTIMIZER_KINDS = (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)

# the piece size (64 MiB of fp32) and read-ahead the engine runs with when they are left to it
# (None, or "auto") and the budgets hold them; smaller where they do not (tierzero.planning.streaming)
PIECE_NUMEL = 16 << 20
PREFETCH_DEPTH = 2


class Offload(str, enum.Enum):
    NONE = "none"
    HOST = "host"
    NVME = "nvme"
    AUTO = "auto"


class DType(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class LRSchedule(str, enum.Enum):
    CONSTANT = "constant"
    COSINE = "cosine"


@dataclass(frozen=True)
class Placement:
    """The home tier of each state kind. `gpu` means the compute device's memory."""

    param: Tier = Tier.GPU
    grad: Tier = Tier.GPU
    master: Tier = Tier.GPU
    exp_avg: Tier = Tier.GPU
    exp_avg_sq: Tier = Tier.GPU

    def home(self, kind: StateKind) -> Tier:
        return getattr(self, kind.value)

    @classmethod
    def for_offload(cls, offload: Offload) -> Placement:
        """The preset placement behind `--offload none|host|nvme` (`auto` asks the planner)."""
        if offload is Offload.NONE:
            return cls()
        if offload is Offload.HOST:
            return cls(Tier.GPU, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)
        if offload is Offload.NVME:
            return cls(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
        raise ConfigError(
            "offload 'auto' has no fixed placement; ask tierzero.planning.placement for one"
        )

    def describe(self) -> str:
        return " ".join(f"{k.value}={self.home(k).value}" for k in StateKind)


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}


def parse_bytes(value: int | float | str, what: str) -> int:
    """`8GiB`, `512MB`, `1e9` or an int -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{what} must be a positive size in bytes, got {value}", key=what)
        return int(value)
    m = _SIZE_RE.match(str(value))
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"{what} '{value}' is not a size; write it like 8GiB, 512MB or 1000000", key=what
        )
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def _enum(cls: type[enum.Enum], value: Any, what: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        choices = "|".join(m.value for m in cls)
        raise ConfigError(
            f"{what} '{value}' is not valid; choose one of {choices}", key=what
        ) from None


class Schedule(str, enum.Enum):
    """How `accumulate` micro-batches go through the units (`tierzero.engine.vertical.schedule`)."""

    HORIZONTAL = "horizontal"  # each micro-batch through every unit, forward then backward
    VERTICAL = "vertical"  # each unit for every micro-batch: params fetched once per pass
    AUTO = "auto"  # vertical where accumulating a chain model (built-in or a split HF decoder), else horizontal


class LongExamples(str, enum.Enum):
    """What happens to a fine-tuning example longer than a window (`tierzero.run.packing`)."""

    TRUNCATE = "truncate"  # keep the prompt's end and the reply's start
    SPLIT = "split"  # windows that share one token; later ones train without the prompt
    DROP = "drop"


class Recompute(str, enum.Enum):
    """Which units' forwards run again in backward (`tierzero.planning.recompute`)."""

    AUTO = "auto"  # keep the activations of as many blocks as the compute device's budget holds
    ALL = "all"  # every unit keeps only its input and is recomputed (activation checkpointing)
    NONE = "none"  # every block keeps its activations; refused where they do not fit


class StateFormat(str, enum.Enum):
    """How the two Adam moments are stored on every tier and in checkpoints (`tierzero.compact`)."""

    FP32 = "fp32"  # exact: bitwise torch.optim.AdamW
    BF16 = "bf16"
    INT8 = "int8"  # blockwise dynamic quantisation: STATE_BLOCK values share one fp32 absmax


# values per int8 quantisation block; pieces (multiples of 2048) hold whole blocks, so a piece
# quantises alone. 256, not 8-bit Adam's 2048: a smaller block's absmax sits closer to its
# values, which then land on finer codes (docs/design.md, "Compact optimizer state")
STATE_BLOCK = 256


@dataclass
class Config:
    """What the `Engine` needs: precision, optimizer, schedule and where state lives.

    `placement=None` derives the placement from `offload`; budgets of `None` mean "a safe
    share of what the machine has" and are resolved when the engine opens. `piece_numel` and
    `prefetch_depth` of `None` (or "auto") are `PIECE_NUMEL` and `PREFETCH_DEPTH` where the
    budgets hold them, else chosen by the engine to fit; a value given is used as it is.
    """

    offload: Offload = Offload.NVME
    nvme_path: list[str] = field(default_factory=lambda: ["tierzero-nvme"])
    dtype: DType | None = None  # None: bf16 on GPUs that have it, else fp32
    device: str | None = None
    placement: Placement | None = None
    host_budget: int | None = None
    gpu_budget: int | None = None
    prefetch_depth: int | None = None  # units fetched ahead; None: PREFETCH_DEPTH, or less to fit
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    lr_schedule: LRSchedule = LRSchedule.COSINE
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.1
    clip_grad_norm: float | None = None
    optimizer_state: StateFormat = StateFormat.FP32  # the Adam moments' stored format
    master: DType = DType.FP32  # the master weights' stored dtype: fp32 (exact) or bf16
    clip_previous_norm: bool = (
        False  # opt-in approximation: overlap_step clips by the previous norm, never re-steps
    )
    accumulate: int = 1
    schedule: Schedule = Schedule.AUTO
    recompute: Recompute = Recompute.AUTO
    # the vertical schedule's waiting activations in host memory (beyond it they spill to nvme);
    # None: what the host budget leaves
    activation_budget: int | None = None
    loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    # None: on wherever it is free (no clipping, not fp16); True with clipping: exact, a fired clip re-steps
    overlap_step: bool | None = None
    grad_reduce_dtype: DType = (
        DType.FP32
    )  # what grads are summed over ranks in: fp32 (exact) or bf16
    overlap_comm: bool = (
        True  # several ranks: all-gather a use ahead, finish reduce-scatters a unit later
    )
    # several ranks, ZeRO stage: 3 partitions params, grads and optimizer states (each use
    # all-gathers a unit's params); 2 replicates params (no gathers in the pass; one all-gather
    # of the new values per unit per step); 1 also keeps full grads over the micro-batches,
    # reduced once per step. None: the engine picks the least communication that fits.
    stage: int | None = None
    seed: int = 0
    units: str | None = None
    chunk_bytes: int = 8 << 20
    piece_numel: int | None = (
        None  # elements per piece grads and optimizer states stream in; None: chosen
    )
    io_threads: int = 16
    verify_reads: str = (
        "auto"  # crc32c-check every NVMe read: on, off, or auto (on where it is cheap)
    )
    # a frozen base's linear weights stored in 4 bits (`tierzero.models.nf4`), or "none"
    quantize_base: str = "none"
    profile: str | None = None

    def __post_init__(self) -> None:
        self.offload = _enum(Offload, self.offload, "offload")
        self.dtype = None if self.dtype is None else _enum(DType, self.dtype, "dtype")
        self.lr_schedule = _enum(LRSchedule, self.lr_schedule, "lr_schedule")
        self.schedule = _enum(Schedule, self.schedule, "schedule")
        self.recompute = _enum(Recompute, self.recompute, "recompute")
        self.optimizer_state = _enum(StateFormat, self.optimizer_state, "optimizer_state")
        self.master = _enum(DType, self.master, "master")
        if self.master is DType.FP16:
            raise _refused(
                "master", "must be fp32 or bf16, got 'fp16' (too few exponent bits for weights)"
            )
        self.grad_reduce_dtype = _enum(DType, self.grad_reduce_dtype, "grad_reduce_dtype")
        if self.grad_reduce_dtype is DType.FP16:
            raise ConfigError(
                "grad_reduce_dtype 'fp16' could overflow a sum of gradients; choose fp32 or bf16"
            )
        if isinstance(self.nvme_path, (str, Path)):
            self.nvme_path = [str(self.nvme_path)]
        self.nvme_path = [str(p) for p in self.nvme_path]
        if not self.nvme_path:
            raise ConfigError("nvme_path is empty; give at least one directory on a local SSD")
        if isinstance(self.placement, dict):
            self.placement = placement_from_dict(self.placement)
        for name in ("host_budget", "gpu_budget", "chunk_bytes", "activation_budget"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, parse_bytes(value, name))
        self.piece_numel = None if self.piece_numel == "auto" else self.piece_numel
        self.prefetch_depth = None if self.prefetch_depth == "auto" else self.prefetch_depth
        if self.piece_numel is not None and (
            isinstance(self.piece_numel, bool)
            or not isinstance(self.piece_numel, int)
            or self.piece_numel <= 0
            or self.piece_numel % 2048
        ):
            raise _refused(
                "piece_numel",
                f"must be a positive multiple of 2048 elements (aligned in every "
                f"dtype) or auto, got {self.piece_numel!r}; e.g. 16777216 (64 MiB of fp32)",
            )
        if self.chunk_bytes <= 0 or self.chunk_bytes % 4096:
            raise _refused(
                "chunk_bytes", f"must be a positive multiple of 4096, got {self.chunk_bytes}"
            )
        if self.verify_reads not in ("auto", "on", "off"):
            raise _refused("verify_reads", f"must be auto, on or off, got {self.verify_reads!r}")
        if self.quantize_base not in ("none", "nf4"):
            raise _refused("quantize_base", f"must be nf4 or none, got {self.quantize_base!r}")
        self._check_optimizer()
        if self.stage is not None and (isinstance(self.stage, bool) or self.stage not in (1, 2, 3)):
            raise _refused("stage", f"must be 1, 2 or 3 (or unset to choose), got {self.stage!r}")
        depth = self.prefetch_depth
        if depth is not None and (not _whole(depth) or depth < 0):
            raise _refused("prefetch_depth", f"must be an integer >= 0 or auto, got {depth!r}")
        _positive(self.io_threads, "io_threads", strict=True)

    def _check_optimizer(self) -> None:
        """The step's numbers: every one finite, since a NaN or infinite hyper-parameter trains
        to NaN (weight decay) or freezes every weight (eps) without another word."""
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise _refused(
                "betas",
                f"must be two numbers in [0, 1), got {self.betas}; e.g. --adam-betas 0.9,0.95",
            )
        _positive(self.lr, "lr", strict=True)
        _positive(self.eps, "eps", strict=True)
        _positive(self.weight_decay, "weight_decay")
        _positive(self.warmup_steps, "warmup_steps")
        if not _number(self.min_lr_ratio) or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise _refused("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.total_steps is not None:
            _positive(self.total_steps, "total_steps", strict=True)
        if self.clip_grad_norm is not None:
            _positive(self.clip_grad_norm, "clip_grad_norm", strict=True)
        if not _whole(self.accumulate) or self.accumulate < 1:
            raise _refused("accumulate", f"must be an integer >= 1, got {self.accumulate!r}")
        scale = self.loss_scale
        if not _number(scale) or scale <= 0 or not math.log2(scale).is_integer():
            raise _refused("loss_scale", f"must be a power of two (like 65536), got {scale!r}")
        _positive(self.loss_scale_window, "loss_scale_window", strict=True)

    def resolved_device(self) -> torch.device:
        """`device`, or the GPU when there is one, else the CPU; a GPU always with its index
        (`cuda` is the current device now), so threads with another current device use it too."""
        if self.device is not None:
            return bound_device(torch.device(self.device))
        return bound_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))

    def resolved_placement(self) -> Placement:
        """The explicit placement, or the preset for `offload` (`auto` is resolved by the engine)."""
        return self.placement if self.placement is not None else Placement.for_offload(self.offload)


def placement_from_dict(d: dict[str, Any]) -> Placement:
    unknown = set(d) - {k.value for k in StateKind}
    if unknown:
        raise ConfigError(
            f"placement has unknown state kinds {sorted(unknown)}; "
            f"use {', '.join(k.value for k in StateKind)}"
        )
    return Placement(**{k: _enum(Tier, v, f"placement.{k}") for k, v in d.items()})


@dataclass
class RunConfig:
    """What `tierzero train` needs on top of the engine: model, data, loop length, run dir."""

    model: str = "tiny"  # a preset, or hf:<local dir> of a Hugging Face causal LM
    data: str | None = None
    text_field: str = "text"  # the field of a .jsonl record that holds its text
    weights: str | None = None  # local .safetensors file or directory to start from
    steps: int = 80
    batch_size: int = 8
    seq_len: int = 128
    run_dir: str | None = None
    eval_every: int | None = 40  # optimizer steps between evaluations; 0 or None: none
    eval_tokens: int = (
        4096  # the validation set: this many tokens' windows, whatever the batch size
    )
    val_data: str | None = None  # held-out data (any format `data` takes); None: a split of `data`
    val_fraction: float | None = (
        None  # the end of `data` held out; None: 5% where the corpus spares it
    )
    keep_best: bool = (
        False  # checkpoint at each evaluation that improves, keep the best through pruning
    )
    long_examples: LongExamples = LongExamples.TRUNCATE
    checkpoint_every: int | None = None  # None: checkpoint only when the run finishes
    keep_checkpoints: int = 2
    lora_r: int | None = (
        None  # LoRA rank: train peft adapters on a frozen hf: base; None: full training
    )
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list[str] | None = (
        None  # module names to adapt; None: peft's default for the model
    )
    report_to: list[str] = field(default_factory=list)  # trackers, checked by tierzero.run.trackers
    sample_prompts: str | None = (
        None  # a prompts file completed during training (tierzero.run.samples)
    )
    sample_every: int | None = None  # steps between samples; None: at the end only
    sample_max_new_tokens: int = 64
    drive_tbw: float | None = (
        None  # the NVMe drive's rated terabytes written: the run's writes against it
    )
    engine: Config = field(default_factory=Config)

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "eval_tokens",
            "keep_checkpoints",
            "sample_max_new_tokens",
        ):
            _count(getattr(self, name), name)
        if self.sample_every is not None:
            _count(self.sample_every, "sample_every")
        if self.drive_tbw is not None:
            _positive(self.drive_tbw, "drive_tbw", strict=True)
        if self.eval_every not in (0, None):
            _count(self.eval_every, "eval_every")
        fraction = self.val_fraction
        if fraction is not None and (not _number(fraction) or not 0 <= fraction < 1):
            raise _refused(
                "val_fraction",
                f"must be a number in [0, 1) (the corpus's share held out), got {fraction!r}",
            )
        if fraction is not None and self.val_data is not None:
            raise ConfigError(
                "--val-data and --val-fraction both name a validation set; pass one of them"
            )
        try:
            self.long_examples = LongExamples(self.long_examples)
        except ValueError:
            raise _refused(
                "long_examples",
                f"must be one of {', '.join(e.value for e in LongExamples)}, "
                f"got {self.long_examples!r}",
            ) from None
        if not isinstance(self.text_field, str) or not self.text_field:
            raise _refused("text_field", f"must name a .jsonl field, got {self.text_field!r}")
        every = self.checkpoint_every
        if every is not None and (
            isinstance(every, bool) or not isinstance(every, int) or every < 1
        ):
            raise _refused(
                "checkpoint_every", f"must be an integer >= 1 (optimizer steps), got {every!r}"
            )
        self._check_lora()

    def _check_lora(self) -> None:
        r, targets = self.lora_r, self.lora_targets
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise _refused("lora_r", f"must be an integer >= 1 (the adapters' rank), got {r!r}")
        _positive(self.lora_alpha, "lora_alpha", strict=True)
        if not _number(self.lora_dropout) or not 0 <= self.lora_dropout < 1:
            raise _refused("lora_dropout", f"must be a number in [0, 1), got {self.lora_dropout!r}")
        if targets is not None and (
            not isinstance(targets, list)
            or not targets
            or not all(isinstance(t, str) and t for t in targets)
        ):
            raise _refused(
                "lora_targets", f"must be module names such as q_proj,v_proj, got {targets!r}"
            )

    def check_ranks(self, world_size: int) -> None:
        """Refuse what several ranks cannot train: a global batch that does not split evenly,
        or the in-memory reference trainer (one process, no collectives)."""
        if world_size == 1:
            return
        if self.batch_size % world_size:
            raise ConfigError(
                f"--batch-size {self.batch_size} (the global batch) does not split evenly over "
                f"{world_size} ranks; use a multiple of {world_size}"
            )
        if self.engine.offload is Offload.NONE:
            raise ConfigError(
                f"--offload none trains in memory on one rank, not {world_size}; use --offload "
                "host, nvme or auto with several ranks"
            )


TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FP32: torch.float32,
    DType.BF16: torch.bfloat16,
    DType.FP16: torch.float16,
}


def bound_device(device: torch.device) -> torch.device:
    """`device` with its index: `cuda` means the current device *now*, on the training thread,
    never whatever device a later caller's thread has current."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
