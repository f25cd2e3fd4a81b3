"""`BackwardPass`: one backward's own facts, handed to the gradient shards and the unit runner
for the length of that pass (`GradShards.running`, `UnitRunner.running`) instead of callbacks
patched onto them.

Every backward accumulates each unit's gradient into its home: which micro-batch of the step
it is, whether it ends the step, the loss scale to undo and the gradients that reached open
`gathered` blocks belong to the pass. With overlap_step the step's last pass also steps each
unit as its gradient arrives (`StepInBackward`: this step's lr, the runs to update and, with
clipping, either the previous step's norm's coefficient (clip_previous_norm) or a kept
generation to re-step from once this step's norm is known, `Stepper`), reading a unit's
optimizer states ahead while the unit before it in backward order still computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierzero.config import OptimizerSettings
from tierzero.engine.gathered import UnitGrad
from tierzero.engine.step.optim import ShardOptimizer
from tierzero.engine.step.restep import KeptGeneration
from tierzero.engine.step.skipped import Run
from tierzero.engine.step.state import StepState
from tierzero.layout.partition import Unit
from tierzero.lr import lr_at


@dataclass(frozen=True)
class StepInBackward:
    """overlap_step: the optimizer steps each unit's finished grad shard, never stored."""

    optimizer: ShardOptimizer
    units: list[Unit]
    lr: float
    coef: float | None  # clip_previous_norm's factor as a host float; None: not clipped now
    runs: Callable[[Unit], list[Run]]  # what of this rank's shard the step updates

    @staticmethod
    def for_step(
        optimizer: ShardOptimizer,
        units: list[Unit],
        settings: OptimizerSettings,
        state: StepState,
        runs: Callable[[Unit], list[Run]],
    ) -> StepInBackward:
        """The step of `state`'s step count; it marks the step as taken in backward."""
        coef = None  # clip_previous_norm: the first step is not clipped
        if settings.clip_grad_norm is not None and not settings.clip_previous_norm:
            # exact: stepped unclipped, re-stepped from what is kept if the clip fires
            optimizer.kept = KeptGeneration.begin(optimizer.placement, optimizer.tiers.stores)
        elif settings.clip_grad_norm is not None and state.previous_norm is not None:
            # a host float from the host copy of the norm: no device sync in backward, and
            # no device tensor for each CPU piece's step to copy to the host
            coef = clip_coefficient(state.previous_norm, settings.clip_grad_norm).item()
        state.stepped_in_backward = True
        return StepInBackward(optimizer, units, lr_at(state.step_count, settings), coef, runs)

    def unit_starting(self, unit: int) -> None:
        """Read the states of this unit and the next one in backward order ahead of their grads."""
        for v in (unit, unit - 1):
            if v >= 0:
                self.optimizer.prefetch(self.units[v])

    def grad_ready(self, unit: Unit, grad: torch.Tensor) -> None:
        self.optimizer.step_unit(unit, grad, self.runs(unit), self.lr, self.coef)


@dataclass(frozen=True)
class BackwardPass:
    micro: int = 0  # the micro-batch's index within its step
    last: bool = True  # it ends the step: its grads are final
    inv_scale: float = 1.0  # undoes the loss scale
    # grads that reached `gathered` copies, by unit; each is taken once, at its unit's first grad
    extra: dict[int, UnitGrad] = field(default_factory=dict)
    step: StepInBackward | None = None
    # the vertical schedule: each unit's grad arrives once, already summed over its uses (a
    # tied embedding's) and the step's micro-batches (`tierzero.engine.vertical.schedule`)
    combined: bool = False

    def unit_starting(self, unit: int) -> None:
        """A unit's backward begins (the runner calls this before regathering it)."""
        if self.step is not None:
            self.step.unit_starting(unit)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_`'s factor, computed the same way (fp32 tensor arithmetic, clamped to 1)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
