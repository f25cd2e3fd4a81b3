"""`StepCounters`: the step's counters in one record -- what `Engine.backward` and the stepper
advance, what the vertical schedule reads the loss scale from, and what a checkpoint saves and
restores besides the shards."""

from __future__ import annotations

from dataclasses import dataclass

from tierzero.engine.step.skipped import SkippedSteps
from tierzero.engine.step.state import StepState
from tierzero.precision import DynamicLossScaler


@dataclass(frozen=True)
class StepCounters:
    """The step's counters, changed in place: steps and micro-batches taken (`StepState`),
    fp16's loss scale, and each parameter's updates (`SkippedSteps`); a checkpoint saves them."""

    state: StepState
    scaler: DynamicLossScaler
    param_steps: SkippedSteps
