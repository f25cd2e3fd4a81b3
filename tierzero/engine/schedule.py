"""`StepSchedule`: how one optimizer step's micro-batches go through the units -- the one
interface the Engine trains through, with two implementations chosen at the first training
micro-batch (`--schedule auto|horizontal|vertical`; the choice is
`tierzero.engine.vertical.schedule.choose`).

`HorizontalSteps` (here): each micro-batch through every unit, forward then backward, the step
at the last; the Engine's own `forward`/`backward`/`step`, which a user's loop may also call.
`VerticalSteps` (`tierzero.engine.vertical.schedule`): each unit for every micro-batch of the
step, its params fetched once per pass, the micro-batches queued until the step's last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class StepSchedule(Protocol):
    def micro_batch(self, batch: Any, step_tokens: int | None = None) -> torch.Tensor:
        """Train one micro-batch (the step runs at the step's last); a tensor that holds its
        loss (once its step has run, for a schedule that queues)."""
        ...

    def refuse_queued(self) -> None:
        """Refuse a checkpoint while micro-batches wait: they would be lost on resume."""
        ...

    def abort(self) -> None:
        """Drop what a failed pass holds (queued micro-batches, waiting activations)."""
        ...


class HorizontalSteps:
    """Each micro-batch forward then backward through every unit, the step at the last."""

    def __init__(
        self,
        forward: Callable[[Any, int | None], torch.Tensor],
        backward: Callable[[torch.Tensor], None],
        step: Callable[[], bool],
    ) -> None:
        self.forward, self.backward, self.step = forward, backward, step

    def micro_batch(self, batch: Any, step_tokens: int | None = None) -> torch.Tensor:
        loss = self.forward(batch, step_tokens)
        self.backward(loss)
        self.step()
        return loss.detach()

    def refuse_queued(self) -> None:
        """Nothing waits between calls: every micro-batch's backward has run."""

    def abort(self) -> None:
        """Nothing is held between calls."""
