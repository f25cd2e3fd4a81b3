"""Every candidate placement costed as the engine would run it, the choice, and its ZeRO stage.

Owns the order in which `tierzero plan` asks what the engine asks (`engine.sizing`): each
candidate at the streaming defaults; the streaming ladder only where nothing fits stage 3 at
them (so budgets the defaults fit keep every choice they made before), then per placement the
first rung that fits (a placement that fits at none costed at the defaults); the choice; then
the least communication whose state fits (`placement.choose_stage`), every candidate re-costed
at that stage. Arithmetic over `placement.estimate`: it never probes the machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from tierzero.config import Placement, Tier
from tierzero.planning.placement import (
    PlacementChoice,
    PlacementEstimate,
    Profile,
    choose,
    choose_stage,
    estimate,
)
from tierzero.planning.streaming import Streaming, choose_streaming, streamed
from tierzero.planning.workload import Workload


@dataclass(frozen=True)
class Costed:
    """Every candidate's estimate, the choice and the workload it is costed at (streaming as
    the engine would run it), and the ZeRO stage and why."""

    estimates: list[PlacementEstimate]
    choice: PlacementChoice
    workload: Workload
    stage: int
    stage_reason: str


@dataclass(frozen=True)
class Costing:
    """The candidates, budgets and profile, and the streaming settings given (None: left to
    the planner, as `tierzero train` leaves them to the engine)."""

    candidates: list[Placement]
    budgets: dict[Tier, int | None]
    profile: Profile | None = None
    piece_numel: int | None = None
    prefetch_depth: int | None = None

    def cost(self, work: Workload, forced_stage: int | None) -> Costed:
        """Cost every candidate for `work` and choose, as the module docstring says."""
        at_defaults = [estimate(p, work, self.profile) for p in self.candidates]
        at_stage3 = (
            at_defaults
            if work.stage == 3
            else [estimate(p, dataclasses.replace(work, stage=3)) for p in self.candidates]
        )
        walk = None in (self.piece_numel, self.prefetch_depth) and all(
            e.overflow_bytes(self.budgets) for e in at_stage3
        )
        estimates, works = (
            self._cost_all(work, walk, at_defaults)
            if walk
            else (at_defaults, {e.placement: work for e in at_defaults})
        )
        choice = choose(estimates, self.budgets)
        chosen, reason = choose_stage(
            lambda s: (
                not estimate(
                    choice.placement,
                    self._fitted(choice.placement, dataclasses.replace(work, stage=s), walk),
                ).overflow_bytes(self.budgets)
            ),
            work.world_size,
            work.accumulate,
            forced_stage,
        )
        if chosen != work.stage:  # the engine keeps the placement and replicates: cost every
            # one at that stage
            estimates, works = self._cost_all(dataclasses.replace(work, stage=chosen), walk)
            mine = next(e for e in estimates if e.placement == choice.placement)
            choice = PlacementChoice(mine, fits=True)
        return Costed(estimates, choice, works[choice.placement], chosen, reason)

    def _fitted(self, p: Placement, w: Workload, walk: bool) -> Workload:
        """`w` streaming as the engine would run it at `p`: when walking, the first rung that
        fits (the settings given kept), else (or where none does) `w`'s own."""
        fit = (
            choose_streaming(
                w,
                p,
                self.budgets,
                piece_numel=self.piece_numel,
                prefetch_depth=self.prefetch_depth,
            )
            if walk
            else None
        )
        return streamed(w, fit) if isinstance(fit, Streaming) else w

    def _cost_all(
        self, w: Workload, walk: bool, known: Sequence[PlacementEstimate] = ()
    ) -> tuple[list[PlacementEstimate], dict[Placement, Workload]]:
        """Every placement's estimate as `_fitted` streams it (`known`: those at `w` itself)."""
        works = {p: self._fitted(p, w, walk) for p in self.candidates}
        at_w = {e.placement: e for e in known}
        return [
            at_w[p] if pw is w and p in at_w else estimate(p, pw, self.profile)
            for p, pw in works.items()
        ], works
