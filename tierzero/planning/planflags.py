"""`tierzero plan`'s flags, by section: what `tierzero.plan(model, **flags)` takes.

`PlanFlags` is built from flat keys (`gpus=8`, `host_mem="512GB"`, `accumulate=4`), as the CLI's
flags and `tierzero.plan`'s keywords name them; each key picks its section (`config.sectioned`),
and each section checks its own values with a refusal that names the flag. A value left None is
chosen as `tierzero train` chooses it on this machine (`tierzero.planning.planreport`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tierzero.config import (
    DType,
    Evaluation,
    OptimizerDevice,
    Recompute,
    RunConfig,
    Schedule,
    StateFormat,
)
from tierzero.config.sectioned import Sectioned
from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit
from tierzero.models.presets import ModelArgs
from tierzero.planning.ledger import check_world_size
from tierzero.planning.wear import check_drive_tbw


class BaseFormat(str, enum.Enum):
    """`--quantize-base`: how a frozen base's linear weights are stored."""

    NONE = "none"
    NF4 = "nf4"


@dataclass(frozen=True)
class MachineFlags:
    """The machine: `gpus` data-parallel ranks (None: one, computing as `tierzero train` does
    here; given, even 1, GPUs computing in bf16 unless `dtype` says otherwise), each tier's size
    ("80GB", or bytes; None: this machine's, as train takes it), where offloaded state would go
    (for the free-space default), and a `tierzero bench --profile-out` file (predicts step
    times)."""

    gpus: int | None = None
    gpu_mem: str | int | None = None
    host_mem: str | int | None = None
    nvme_free: str | int | None = None
    nvme_path: str | Path = "."
    profile: str | Path | None = None

    def __post_init__(self) -> None:
        if self.gpus is not None:
            check_world_size(self.gpus)


@dataclass(frozen=True)
class ShapeFlags:
    """The shape besides the model's name: a parameter count shaped like the nearest preset
    (`params`, e.g. "7e9") or a preset's vocabulary changed; or a model built elsewhere (the
    CLI's hf:DIR): its `units` partitioned for the ranks, `args` the LLaMA-like shape its
    activations are estimated from, and why the vertical schedule cannot drive it
    (`not_a_chain`, `engine.vertical.chain.chain_of`; units that are not an embedding, blocks
    and a head say so themselves)."""

    params: str | int | None = None
    vocab_size: int | None = None
    units: Sequence[Unit] | None = None
    args: ModelArgs | None = None
    not_a_chain: str | None = None

    def __post_init__(self) -> None:
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ConfigError(f"--vocab-size must be a positive integer, got {self.vocab_size}")
        units = self.units
        if units is None:
            return
        if self.args is None or self.params is not None or self.vocab_size is not None:
            raise ConfigError(
                "a built model's plan takes its own shape; drop --params and --vocab-size"
            )
        if self.not_a_chain is None and (units[0].kind != "embedding" or units[-1].kind != "head"):
            why = "its units are not an embedding, blocks and a head"
            object.__setattr__(self, "not_a_chain", why)


@dataclass(frozen=True)
class StepFlags:
    """How a step runs: sequences per micro-batch per GPU and tokens each (None: train's
    defaults), `accumulate` micro-batches in a `schedule` (horizontal, vertical, or auto:
    vertical wherever it applies when accumulating), which blocks `recompute` their forward
    (auto, all, none), where the optimizer steps (`optimizer_device`), units stepped during
    backward (`overlap`), the ZeRO stage (None: chosen
    as the engine chooses it), and the streaming settings (None: chosen as the engine chooses
    them, `tierzero.planning.costing`)."""

    batch_size: int | None = None
    seq_len: int | None = None
    accumulate: int = 1
    schedule: Schedule = Schedule.AUTO
    recompute: Recompute = Recompute.AUTO
    optimizer_device: OptimizerDevice = OptimizerDevice.AUTO
    overlap: bool = True
    stage: int | None = None
    piece_numel: int | None = None
    prefetch_depth: int | None = None

    def __post_init__(self) -> None:
        if self.stage is not None and self.stage not in (1, 2, 3):
            raise ConfigError(f"--stage must be 1, 2 or 3, got {self.stage}")
        for name, least in (
            ("batch_size", 1),
            ("seq_len", 1),
            ("accumulate", 1),
            ("prefetch_depth", 0),
        ):
            check_count(name, getattr(self, name), least)
        piece = self.piece_numel
        if piece is not None and (
            isinstance(piece, bool) or not isinstance(piece, int) or piece <= 0 or piece % 2048
        ):
            raise ConfigError(
                f"--piece-numel must be a positive multiple of 2048 elements, got {piece!r}; "
                "e.g. 16777216 (64 MiB of fp32)"
            )
        object.__setattr__(self, "schedule", choice(Schedule, self.schedule, "--schedule"))
        object.__setattr__(self, "recompute", choice(Recompute, self.recompute, "--recompute"))
        device = choice(OptimizerDevice, self.optimizer_device, "--optimizer-device")
        object.__setattr__(self, "optimizer_device", device)

    @property
    def left_open(self) -> tuple[str, ...]:
        """The streaming settings left to the planner."""
        given = (("piece_numel", self.piece_numel), ("prefetch_depth", self.prefetch_depth))
        return tuple(name for name, v in given if v is None)


@dataclass(frozen=True)
class FormatFlags:
    """How state is stored: the compute dtype (None: bf16 for GPUs described, else train's
    here), the Adam moments (fp32, bf16, int8) and the master (fp32, bf16) on every tier
    (`tierzero.planning.statebytes`), and a frozen base's linear weights (none, or nf4:
    `tierzero.planning.codedbase`; a built model with adapters, one rank, params off the GPU,
    as `tierzero train --quantize-base nf4` takes it)."""

    dtype: DType | None = None
    optimizer_state: StateFormat = StateFormat.FP32
    master: DType = DType.FP32
    quantize_base: BaseFormat = BaseFormat.NONE

    def __post_init__(self) -> None:
        if self.dtype is not None:
            try:
                object.__setattr__(self, "dtype", DType(str(self.dtype).lower()))
            except ValueError:
                raise ConfigError(
                    f"--dtype '{self.dtype}' is not valid; choose one of bf16|fp16|fp32"
                ) from None
        state = choice(StateFormat, self.optimizer_state, "--optimizer-state")
        object.__setattr__(self, "optimizer_state", state)
        object.__setattr__(self, "master", choice(DType, self.master, "--master"))
        if self.master is DType.FP16:
            raise ConfigError(
                "--master 'fp16' has too few exponent bits for weights; choose fp32 or bf16"
            )
        base = choice(BaseFormat, self.quantize_base, "--quantize-base")
        object.__setattr__(self, "quantize_base", base)


@dataclass(frozen=True)
class RunLength:
    """The run whose NVMe writes `PlanReport.wear` projects -- its steps, checkpoint interval
    and the drive's rated terabytes written -- and the evaluation set `evaluation` costs."""

    steps: int = RunConfig.steps
    checkpoint_every: int | None = None
    drive_tbw: float | None = None
    eval_tokens: int = Evaluation.eval_tokens

    def __post_init__(self) -> None:
        check_count("steps", self.steps, 1)
        check_count("checkpoint_every", self.checkpoint_every, 1)
        check_count("eval_tokens", self.eval_tokens, 1)
        check_drive_tbw(self.drive_tbw)


@dataclass(frozen=True, init=False)
class PlanFlags(Sectioned):
    """Every flag of `tierzero plan`, by section; built from flat keys."""

    SECTIONS: ClassVar[dict[str, type]] = {
        "machine": MachineFlags,
        "shape": ShapeFlags,
        "step": StepFlags,
        "formats": FormatFlags,
        "run": RunLength,
    }

    machine: MachineFlags
    shape: ShapeFlags
    step: StepFlags
    formats: FormatFlags
    run: RunLength

    @property
    def described(self) -> bool:
        """Whether GPUs were named (`gpus` given): the plan is then for GPUs in bf16."""
        return self.machine.gpus is not None


def check_count(name: str, value: int | None, least: int) -> None:
    """Refuse a count below `least` (or not an integer), naming its flag."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < least
    ):
        flag = "--" + name.replace("_", "-")
        raise ConfigError(f"{flag} must be an integer >= {least}, got {value!r}")


def choice(cls: Any, value: Any, flag: str) -> Any:
    """`value` as one of enum `cls`'s spellings, or the refusal naming `flag` and its choices."""
    try:
        return cls(str(value.value if isinstance(value, enum.Enum) else value).lower())
    except ValueError:
        raise ConfigError(
            f"{flag} '{value}' is not valid; choose one of {'|'.join(m.value for m in cls)}"
        ) from None
