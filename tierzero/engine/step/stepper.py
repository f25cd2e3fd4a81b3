"""`Stepper`: the step policy over an engine's parts -- when a global batch is stepped, how
(clipped, skipped for an fp16 overflow, or already stepped unit by unit in backward and only
settled here), what each backward is told, and what a failed pass leaves behind.

The Engine's `backward` and the vertical schedule both take their `BackwardPass` from here, and
both step through `step`, so the two schedules share one policy. The counters it advances are
`StepState`'s; the runs a step updates are `SkippedSteps`'; the optimizer only executes.
"""

from __future__ import annotations

import torch

from tierzero.config import OptimizerSettings
from tierzero.engine.runtime.layout import RankLayout
from tierzero.engine.runtime.opened import OpenParts
from tierzero.engine.runtime.tiers import Tiers
from tierzero.engine.step.backward import BackwardPass, StepInBackward, clip_coefficient
from tierzero.engine.step.counters import StepCounters
from tierzero.engine.step.paramsync import sync_params
from tierzero.engine.step.skipped import Run
from tierzero.layout.partition import Unit
from tierzero.lr import lr_at


class Stepper:
    """Steps an open engine's shards once per global batch (see the module docstring)."""

    def __init__(
        self,
        layout: RankLayout,
        tiers: Tiers,
        counters: StepCounters,
        settings: OptimizerSettings,
        accumulate: int,
        overlap: bool,
        param_order: list[str],
        opened: OpenParts,
    ) -> None:
        """`accumulate`: micro-batches per step; `overlap`: units are stepped in backward;
        `param_order`: the model's parameter names in its order (the global norm sums so)."""
        self.layout, self.tiers, self.counters, self.settings = layout, tiers, counters, settings
        self.accumulate, self.overlap, self.param_order = accumulate, overlap, param_order
        self.opened = opened
        self.broken: str | None = None  # why a step stopped half-way, leaving partial state

    def backward_pass(
        self, micro: int, last: bool, extra: dict | None = None, combined: bool = False
    ) -> BackwardPass:
        """One backward's facts; with overlap_step the step's last also steps each unit."""
        step = (
            StepInBackward.for_step(
                self.opened.optimizer,
                self.layout.units,
                self.settings,
                self.counters.state,
                self._runs,
            )
            if last and self.overlap
            else None
        )
        scale = 1.0 / self.counters.scaler.scale
        return BackwardPass(micro, last, scale, extra or {}, step, combined)

    def step(self) -> bool:
        """Update every shard if a global batch is complete; False if none ran (or fp16 skipped)."""
        state = self.counters.state
        if not state.step_due(self.accumulate):
            return False
        try:
            state.stepped_at = state.micro
            stepped = self._step()
            if stepped:  # superseded blocks become spares, behind the next step (no sync here)
                self.tiers.flush_behind()
            return stepped
        except BaseException as e:
            self.broken = f"the optimizer step failed: {e!r}"  # some shards are updated, some not
            raise

    def abort(self, broken: str | None = None) -> None:
        """Drop what a pass holds; `broken`: why it stopped half-way (the engine then refuses to go
        on)."""
        self.broken = broken or self.broken
        self.opened.grads.discard()
        self.opened.optimizer.abort()
        self.opened.swap_runner.abort()

    def _step(self) -> bool:
        grads, optimizer = self.opened.grads, self.opened.optimizer
        settings, state, scaler = self.settings, self.counters.state, self.counters.scaler
        self.tiers.pending.drain()  # grads written during backward must land before they are read
        grads.settle()  # and those copied to host memory
        if state.stepped_in_backward:  # overlap_step: every unit was stepped as its grad arrived
            state.stepped_in_backward = False
            # this step's norm: a fired clip re-steps it, or (clip_previous_norm) it clips the
            # next, from this host copy without a device sync
            if settings.clip_grad_norm is not None:
                state.previous_norm = grads.measured.total_norm(self.param_order).cpu()
                state.last_grad_norm = state.previous_norm.item()
                self._settle_clip(state.previous_norm)
            return self._stepped()
        if scaler.enabled and not scaler.update(grads.measured.found_inf()):
            state.skipped_steps += 1  # overflow: nothing is written, the schedule does not advance
            return False
        coef = None
        if settings.clip_grad_norm is not None:
            norm = grads.measured.total_norm(self.param_order)
            state.last_grad_norm = norm.item()
            # a host float (one sync per step): with a device tensor every CPU piece's step
            # would copy it
            coef = clip_coefficient(norm, settings.clip_grad_norm).item()
        optimizer.step(
            {u.index: self._runs(u) for u in self.layout.units},
            lr_at(state.step_count, settings),
            coef,
        )
        return self._stepped()

    def _stepped(self) -> bool:
        """After the optimizer: advance the per-parameter counts and the step; stage 1/2: every
        rank stores whole units, so each gets every rank's new values (`paramsync`)."""
        self.counters.param_steps.advance(self.opened.grads.present)
        if self.layout.comm.world_size > 1 and self.layout.stage <= 2:
            sync_params(self.layout, self.tiers)
        self.counters.state.step_count += 1
        return True

    def _settle_clip(self, norm: torch.Tensor) -> None:
        """Once an overlapped step's global norm is known: where the clip fires, step every kept
        piece again from its kept generation with the coefficient; either way drop the copies."""
        optimizer = self.opened.optimizer
        kept, optimizer.kept = optimizer.kept, None
        if kept is None:  # clip_previous_norm, or no clipping
            return
        coef = clip_coefficient(norm, self.settings.clip_grad_norm).item()
        try:
            if not coef >= 1.0:  # a NaN norm too: clip_grad_norm_ scales the grads by it
                lr = lr_at(self.counters.state.step_count, self.settings)
                optimizer.step({}, lr, coef, kept)
        finally:
            kept.end()

    def _runs(self, unit: Unit) -> list[Run]:
        """What this step updates of this rank's shard of `unit`, with each run's step count."""
        present = self.opened.grads.present.get(unit.index, ())
        step = self.counters.state.step_count
        return self.counters.param_steps.runs(unit, self.layout.rank, present, step)
