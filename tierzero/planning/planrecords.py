"""The records a plan is made of: the model, the machine, the precision, the ZeRO stage, the
recompute choice (`tierzero.planning.report.PlanReport` holds one of each, and the run whose
writes it projects: `planflags.RunLength`). Plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierzero.config import DType, Recompute, Tier
from tierzero.models.presets import ModelArgs
from tierzero.planning.ledger import ActivationEstimate
from tierzero.planning.statebytes import FP32_STATE, StateBytes


@dataclass(frozen=True)
class ModelShape:
    """What is planned: the preset (None when shaped from a parameter count), the shape's name,
    the LLaMA-like shape activations are estimated from, its parameters, and the size the
    ledger table is computed from (a preset's nominal size)."""

    preset: str | None
    shape: str
    args: ModelArgs
    numel: int
    ledger_numel: int


@dataclass(frozen=True)
class Machine:
    """The GPUs (ranks), each tier's budget (None: not bounded), which sizes were detected,
    and the compute device's kind ("cuda" | "cpu")."""

    gpus: int
    budgets: dict[Tier, int | None]
    detected: list[str]
    device: str


@dataclass(frozen=True)
class Precision:
    """The compute dtype and why (`source`: "dtype" given, "gpus" assumed, "train" train's
    default), how the master and moments are stored, and the grads' dtype off the device and
    at home (`statebytes.grad_dtype`) and why."""

    dtype: DType
    source: str = "dtype"
    formats: StateBytes = FP32_STATE
    grad_dtype: DType = DType.FP32
    grad_reason: str = "fp32 compute"


@dataclass(frozen=True)
class StageChoice:
    """The ZeRO stage the estimates are for (several ranks) and why."""

    stage: int = 3
    reason: str = "one rank"


@dataclass(frozen=True)
class RecomputeChoice:
    """`--recompute`, `activations` counting the kept units' graphs (`planning.recompute`),
    how many units could keep theirs, and whether the engine measures them (a model built
    elsewhere: the plan's figures are its LLaMA-like shape's)."""

    recompute: Recompute = Recompute.AUTO
    kept: ActivationEstimate | None = None
    keepable_units: int = 0
    measured: bool = False
