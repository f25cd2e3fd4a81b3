"""`Stepper`: the step policy over an engine's parts -- when a global batch is stepped, how
(clipped, skipped for an fp16 overflow, or already stepped unit by unit in backward and only
settled here), what each backward is told, and what a failed pass leaves behind.

The Engine's `backward` and the vertical schedule both take their `BackwardPass` from here, and
both step through `step`, so the two schedules share one policy. The counters it advances are
`StepState`'s; the runs a step updates are `SkippedSteps`'; the optimizer only executes.
"""

from __future__ import annotations

from typing import Any

import torch

from tierzero.engine.parts import EngineParts
from tierzero.engine.runtime.opened import OpenParts
from tierzero.engine.step.backward import BackwardPass, StepInBackward, clip_coefficient
from tierzero.engine.step.paramsync import sync_params
from tierzero.engine.step.skipped import Run
from tierzero.layout.partition import Unit
from tierzero.lr import lr_at


class Stepper:
    """Steps an open engine's shards once per global batch (see the module docstring)."""

    def __init__(self, parts: EngineParts, opened: OpenParts) -> None:
        self.parts, self.opened = parts, opened
        self.broken: str | None = None  # why a step stopped half-way, leaving partial state
        self._reserved = False

    def reserve_activations(self, batch: Any, vertical: bool) -> None:
        """At the first training step: take its activations out of the budgets (`Sizing`)."""
        if self._reserved:
            return
        self._reserved = True
        p = self.parts
        memory = p.sizing.reserve_activations(
            p.tiers, p.model, batch, p.placement, p.stage, vertical=vertical
        )
        self.opened.runner.kept = (
            p.sizing.kept
        )  # blocks whose forward keeps its graph (`planning.recompute`)
        p.tiers.provision_host(memory)

    def backward_pass(
        self, micro: int, last: bool, extra: dict | None = None, combined: bool = False
    ) -> BackwardPass:
        """One backward's facts; with overlap_step the step's last also steps each unit."""
        p = self.parts
        step = (
            StepInBackward.for_step(self.opened.optimizer, p.units, p.config, p.state, self._runs)
            if last and p.overlap
            else None
        )
        return BackwardPass(micro, last, 1.0 / p.scaler.scale, extra or {}, step, combined)

    def step(self) -> bool:
        """Update every shard if a global batch is complete; False if none ran (or fp16 skipped)."""
        state = self.parts.state
        if not state.step_due(self.parts.config.execution.accumulate):
            return False
        try:
            state.stepped_at = state.micro
            stepped = self._step()
            if stepped:  # superseded blocks become spares, behind the next step (no sync here)
                self.parts.tiers.flush_behind()
            return stepped
        except BaseException as e:
            self.broken = f"the optimizer step failed: {e!r}"  # some shards are updated, some not
            raise

    def abort(self, broken: str | None = None) -> None:
        """Drop what a pass holds; `broken`: why it stopped half-way (the engine then refuses to go on)."""
        self.broken = broken or self.broken
        self.opened.grads.discard()
        self.opened.optimizer.abort()
        self.opened.swap_runner.abort()

    def _step(self) -> bool:
        p, grads, optimizer = self.parts, self.opened.grads, self.opened.optimizer
        config, state = p.config, p.state
        p.tiers.pending.drain()  # grads written during backward must land before they are read
        grads.settle()  # and those copied to host memory
        if state.stepped_in_backward:  # overlap_step: every unit was stepped as its grad arrived
            state.stepped_in_backward = False
            if (
                config.optimizer.clip_grad_norm is not None
            ):  # this step's norm: a fired clip re-steps it,
                # or (clip_previous_norm) it clips the next, from this host copy without a device sync
                state.previous_norm = grads.measured.total_norm(p.param_order).cpu()
                state.last_grad_norm = state.previous_norm.item()
                self._settle_clip(state.previous_norm)
            return self._stepped()
        if p.scaler.enabled and not p.scaler.update(grads.measured.found_inf()):
            state.skipped_steps += 1  # overflow: nothing is written, the schedule does not advance
            return False
        coef = None
        if config.optimizer.clip_grad_norm is not None:
            norm = grads.measured.total_norm(p.param_order)
            state.last_grad_norm = norm.item()
            # a host float (one sync per step): with a device tensor every CPU piece's step would copy it
            coef = clip_coefficient(norm, config.optimizer.clip_grad_norm).item()
        optimizer.step(
            {u.index: self._runs(u) for u in p.units},
            lr_at(state.step_count, config.optimizer),
            coef,
        )
        return self._stepped()

    def _stepped(self) -> bool:
        """After the optimizer: advance the per-parameter counts and the step; stage 1/2: every
        rank stores whole units, so each gets every rank's new values (`paramsync`)."""
        p = self.parts
        p.param_steps.advance(self.opened.grads.present)
        if p.comm.world_size > 1 and p.stage <= 2:
            sync_params(p)
        p.state.step_count += 1
        return True

    def _settle_clip(self, norm: torch.Tensor) -> None:
        """Once an overlapped step's global norm is known: where the clip fires, step every kept
        piece again from its kept generation with the coefficient; either way drop the copies."""
        optimizer, config = self.opened.optimizer, self.parts.config
        kept, optimizer.kept = optimizer.kept, None
        if kept is None:  # clip_previous_norm, or no clipping
            return
        coef = clip_coefficient(norm, config.optimizer.clip_grad_norm).item()
        try:
            if not coef >= 1.0:  # a NaN norm too: clip_grad_norm_ scales the grads by it
                optimizer.step({}, lr_at(self.parts.state.step_count, config.optimizer), coef, kept)
        finally:
            kept.end()

    def _runs(self, unit: Unit) -> list[Run]:
        """What this step updates of this rank's shard of `unit`, with each run's step count."""
        p = self.parts
        return p.param_steps.runs(
            unit, p.rank, self.opened.grads.present.get(unit.index, ()), p.state.step_count
        )
