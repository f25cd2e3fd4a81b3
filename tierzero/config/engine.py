"""The engine's `Config`, in sections: where state lives (`Tiering`), how it streams
(`StreamSettings`), the optimizer (`OptimizerSettings`), the stored formats (`FormatSettings`), the
compute precision (`Precision`), how micro-batches run (`Execution`) and how ranks share the
state (`Partitioning`).

Each section checks its own fields with a message that names the key and the fix, so nothing
downstream re-checks user input; each room reads only its section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from tierzero.config.kinds import (
    DType,
    LRSchedule,
    Offload,
    OptimizerDevice,
    Placement,
    Recompute,
    Schedule,
    StateFormat,
    bound_device,
    choice,
    parse_bytes,
    placement_from_dict,
)
from tierzero.config.sectioned import Sectioned
from tierzero.errors import ConfigError
from tierzero.refusals import number, positive, refused, whole


def _set(section: object, name: str, value: Any) -> None:
    """Normalise a field of a frozen section while it checks itself."""
    object.__setattr__(section, name, value)


@dataclass(frozen=True)
class Tiering:
    """Where state lives: the offload preset or an explicit placement, the NVMe directories,
    the host and device budgets (`None`: a safe share of what the machine has, resolved when
    the engine opens) and the compute device (`None`: the GPU if there is one)."""

    offload: Offload = Offload.NVME
    placement: Placement | None = None
    nvme_path: list[str] = field(default_factory=lambda: ["tierzero-nvme"])
    host_budget: int | None = None
    gpu_budget: int | None = None
    device: str | None = None
    # a machine profile (JSON of measured speeds) that `offload auto` places state by
    profile: str | None = None

    def __post_init__(self) -> None:
        _set(self, "offload", choice(Offload, self.offload, "offload"))
        paths = self.nvme_path
        paths = [str(paths)] if isinstance(paths, (str, Path)) else [str(p) for p in paths]
        if not paths:
            raise ConfigError("nvme_path is empty; give at least one directory on a local SSD")
        _set(self, "nvme_path", paths)
        if isinstance(self.placement, dict):
            _set(self, "placement", placement_from_dict(self.placement))
        for name in ("host_budget", "gpu_budget"):
            if getattr(self, name) is not None:
                _set(self, name, parse_bytes(getattr(self, name), name))

    def resolved_device(self) -> torch.device:
        """`device`, or the GPU when there is one, else the CPU; a GPU always with its index
        (`cuda` is the current device now), so threads with another current device use it too."""
        if self.device is not None:
            return bound_device(torch.device(self.device))
        return bound_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))

    def resolved_placement(self) -> Placement:
        """The explicit placement, or the preset for `offload` (`auto` is resolved by the
        engine)."""
        if self.placement is not None:
            return self.placement
        return Placement.for_offload(self.offload)


@dataclass(frozen=True)
class StreamSettings:
    """How state streams between tiers. `piece_numel` and `prefetch_depth` of `None` (or
    "auto") are `PIECE_NUMEL` and `PREFETCH_DEPTH` where the budgets hold them, else chosen by
    the engine to fit; a value given is used as it is."""

    # elements per piece grads and optimizer states stream in; None: chosen
    piece_numel: int | None = None
    # units fetched ahead; None: PREFETCH_DEPTH, or less to fit
    prefetch_depth: int | None = None
    chunk_bytes: int = 8 << 20
    io_threads: int = 16
    # crc32c-check every NVMe read: on, off, or auto (on where it is cheap)
    verify_reads: str = "auto"
    units: str | None = None  # how the model splits into units (`tierzero.layout.partition`)

    def __post_init__(self) -> None:
        _set(self, "chunk_bytes", parse_bytes(self.chunk_bytes, "chunk_bytes"))
        piece = None if self.piece_numel == "auto" else self.piece_numel
        _set(self, "piece_numel", piece)
        depth = None if self.prefetch_depth == "auto" else self.prefetch_depth
        _set(self, "prefetch_depth", depth)
        if piece is not None and (
            isinstance(piece, bool) or not isinstance(piece, int) or piece <= 0 or piece % 2048
        ):
            raise refused(
                "piece_numel",
                "must be a positive multiple of 2048 elements (aligned in every dtype) or "
                f"auto, got {piece!r}; e.g. 16777216 (64 MiB of fp32)",
            )
        if self.chunk_bytes <= 0 or self.chunk_bytes % 4096:
            raise refused(
                "chunk_bytes", f"must be a positive multiple of 4096, got {self.chunk_bytes}"
            )
        if self.verify_reads not in ("auto", "on", "off"):
            raise refused("verify_reads", f"must be auto, on or off, got {self.verify_reads!r}")
        if depth is not None and (not whole(depth) or depth < 0):
            raise refused("prefetch_depth", f"must be an integer >= 0 or auto, got {depth!r}")
        positive(self.io_threads, "io_threads", strict=True)


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW's numbers, the learning-rate schedule and clipping. Every number is checked
    finite: a NaN or infinite hyper-parameter trains to NaN (weight decay) or freezes every
    weight (eps) without another word."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    lr_schedule: LRSchedule = LRSchedule.COSINE
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.1
    clip_grad_norm: float | None = None
    # opt-in approximation: overlap_step clips by the previous norm, never re-steps
    clip_previous_norm: bool = False

    def __post_init__(self) -> None:
        _set(self, "lr_schedule", choice(LRSchedule, self.lr_schedule, "lr_schedule"))
        _set(self, "betas", tuple(float(b) for b in self.betas))
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise refused(
                "betas",
                f"must be two numbers in [0, 1), got {self.betas}; e.g. --adam-betas 0.9,0.95",
            )
        positive(self.lr, "lr", strict=True)
        positive(self.eps, "eps", strict=True)
        positive(self.weight_decay, "weight_decay")
        positive(self.warmup_steps, "warmup_steps")
        if not number(self.min_lr_ratio) or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise refused("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.total_steps is not None:
            positive(self.total_steps, "total_steps", strict=True)
        if self.clip_grad_norm is not None:
            positive(self.clip_grad_norm, "clip_grad_norm", strict=True)


@dataclass(frozen=True)
class FormatSettings:
    """How state is stored on every tier and in checkpoints: the Adam moments' format, the
    master weights' dtype and a frozen base's linear weights (`tierzero.compact`,
    `tierzero.models.nf4`)."""

    optimizer_state: StateFormat = StateFormat.FP32
    master: DType = DType.FP32  # fp32 (exact) or bf16
    quantize_base: str = "none"  # "nf4": a frozen base's linear weights in 4 bits

    def __post_init__(self) -> None:
        state = choice(StateFormat, self.optimizer_state, "optimizer_state")
        _set(self, "optimizer_state", state)
        _set(self, "master", choice(DType, self.master, "master"))
        if self.master is DType.FP16:
            raise refused(
                "master", "must be fp32 or bf16, got 'fp16' (too few exponent bits for weights)"
            )
        if self.quantize_base not in ("none", "nf4"):
            raise refused("quantize_base", f"must be nf4 or none, got {self.quantize_base!r}")


@dataclass(frozen=True)
class Precision:
    """The compute dtype (`None`: bf16 on GPUs that have it, else fp32) and fp16's dynamic
    loss scale."""

    dtype: DType | None = None
    loss_scale: float = 2.0**16
    loss_scale_window: int = 1000

    def __post_init__(self) -> None:
        _set(self, "dtype", None if self.dtype is None else choice(DType, self.dtype, "dtype"))
        scale = self.loss_scale
        if not number(scale) or scale <= 0 or not math.log2(scale).is_integer():
            raise refused("loss_scale", f"must be a power of two (like 65536), got {scale!r}")
        positive(self.loss_scale_window, "loss_scale_window", strict=True)


@dataclass(frozen=True)
class Execution:
    """How a step's micro-batches run through the units: how many, in which schedule, what
    is recomputed, where the vertical schedule's waiting activations wait, whether units are
    stepped in backward, and on which device."""

    accumulate: int = 1
    schedule: Schedule = Schedule.AUTO
    recompute: Recompute = Recompute.AUTO
    # the vertical schedule's waiting activations in host memory (beyond it they spill to
    # nvme); None: what the host budget leaves
    activation_budget: int | None = None
    # None: on wherever it is free (no clipping, not fp16); True with clipping: exact, a fired
    # clip re-steps
    overlap_step: bool | None = None
    optimizer_device: OptimizerDevice = OptimizerDevice.AUTO

    def __post_init__(self) -> None:
        _set(self, "schedule", choice(Schedule, self.schedule, "schedule"))
        _set(self, "recompute", choice(Recompute, self.recompute, "recompute"))
        device = choice(OptimizerDevice, self.optimizer_device, "optimizer_device")
        _set(self, "optimizer_device", device)
        if self.activation_budget is not None:
            budget = parse_bytes(self.activation_budget, "activation_budget")
            _set(self, "activation_budget", budget)
        if not whole(self.accumulate) or self.accumulate < 1:
            raise refused("accumulate", f"must be an integer >= 1, got {self.accumulate!r}")


@dataclass(frozen=True)
class Partitioning:
    """How several ranks share the state. `stage` is the ZeRO stage: 3 partitions params,
    grads and optimizer states (each use all-gathers a unit's params); 2 replicates params (no
    gathers in the pass; one all-gather of the new values per unit per step); 1 also keeps full
    grads over the micro-batches, reduced once per step; None: the engine picks the least
    communication that fits."""

    stage: int | None = None
    grad_reduce_dtype: DType = DType.FP32  # what grads are summed over ranks in
    # all-gather a use ahead, finish reduce-scatters a unit later
    overlap_comm: bool = True

    def __post_init__(self) -> None:
        _set(self, "grad_reduce_dtype", choice(DType, self.grad_reduce_dtype, "grad_reduce_dtype"))
        if self.grad_reduce_dtype is DType.FP16:
            raise ConfigError(
                "grad_reduce_dtype 'fp16' could overflow a sum of gradients; choose fp32 or bf16"
            )
        if self.stage is not None and (isinstance(self.stage, bool) or self.stage not in (1, 2, 3)):
            raise refused("stage", f"must be 1, 2 or 3 (or unset to choose), got {self.stage!r}")


@dataclass(frozen=True, init=False)
class Config(Sectioned):
    """What the `Engine` needs, by section; built from flat keys (`Config(lr=3e-4,
    offload="nvme")`) or whole sections, changed with `replace(**keys)`."""

    SECTIONS: ClassVar[dict[str, type]] = {
        "tiering": Tiering,
        "streaming": StreamSettings,
        "optimizer": OptimizerSettings,
        "formats": FormatSettings,
        "precision": Precision,
        "execution": Execution,
        "partitioning": Partitioning,
    }

    tiering: Tiering
    streaming: StreamSettings
    optimizer: OptimizerSettings
    formats: FormatSettings
    precision: Precision
    execution: Execution
    partitioning: Partitioning
    seed: int = 0
