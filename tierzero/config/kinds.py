"""The config's vocabulary: tiers, state kinds, dtypes, schedules and formats as enums, the
placement of each state kind, and how a size or a choice written as text becomes one of them.

Every section of the config (`tierzero.config.engine`, `tierzero.config.run`) and every room
that names a tier or a dtype imports these, never the sections it does not use.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from tierzero.errors import ConfigError


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
# (None, or "auto") and the budgets hold them; smaller where they do not
# (tierzero.planning.streaming)
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
    """The home tier of each state kind. `gpu` means the compute device's memory. `optimizer`:
    where the step runs when it is not where the states live (`gpu`: on the compute device,
    the states brought up and written back around it); None: the optimizer steps on the GPU
    when master and both moments live there, else on the host (`planning.stepdevice`)."""

    param: Tier = Tier.GPU
    grad: Tier = Tier.GPU
    master: Tier = Tier.GPU
    exp_avg: Tier = Tier.GPU
    exp_avg_sq: Tier = Tier.GPU
    optimizer: Tier | None = None

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
        homes = " ".join(f"{k.value}={self.home(k).value}" for k in StateKind)
        return homes if self.optimizer is None else f"{homes} optimizer={self.optimizer.value}"


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


def choice(cls: type[enum.Enum], value: Any, what: str) -> Any:
    """`value` as a member of `cls` (case-insensitive), or a refusal listing the choices."""
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
    # vertical where accumulating a chain model (built-in or a split HF decoder), else horizontal
    AUTO = "auto"


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


class OptimizerDevice(str, enum.Enum):
    """Where the optimizer steps its pieces (`tierzero.planning.stepdevice`)."""

    AUTO = "auto"  # the planner's pick, from measured speeds
    CPU = "cpu"  # beside the host buffers (on the device only where every state lives there)
    GPU = "gpu"  # on the compute device, its states brought up and written back around it


class StateFormat(str, enum.Enum):
    """How the two Adam moments are stored on every tier and in checkpoints (`tierzero.compact`)."""

    FP32 = "fp32"  # exact: bitwise torch.optim.AdamW
    BF16 = "bf16"
    INT8 = "int8"  # blockwise 8-bit floats: STATE_BLOCK values share one fp32 scale


# values per int8 quantisation block; pieces (multiples of 2048) hold whole blocks, so a piece
# quantises alone. 256, not 8-bit Adam's 2048: a smaller block's scale sits closer to its
# values, which then land on finer codes (docs/design.md, "Compact optimizer state")
STATE_BLOCK = 256


def placement_from_dict(d: dict[str, Any]) -> Placement:
    unknown = set(d) - {k.value for k in StateKind}
    if unknown:
        raise ConfigError(
            f"placement has unknown state kinds {sorted(unknown)}; "
            f"use {', '.join(k.value for k in StateKind)}"
        )
    return Placement(**{k: choice(Tier, v, f"placement.{k}") for k, v in d.items()})


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
