"""`StepState`: the step counters an engine keeps, in one record that checkpoints save and restore.

The engine advances it (`Engine.backward` counts micro-batches, `Engine.step` steps); a
checkpoint writes it into the manifest's `engine` entry and a resume reads it back, so the
next step is the one an uninterrupted run would take. It holds numbers only, never tensors
on a device: the previous step's norm is a host float32 tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepState:
    step_count: int = 0  # optimizer steps taken
    micro: int = 0  # micro-batches backpropagated since the engine opened or resumed
    skipped_steps: int = 0  # fp16 steps skipped for an overflow
    last_grad_norm: float | None = None  # the latest step's global grad norm (clipping only)
    # clip_previous_norm: the norm that clips the next overlapped step (host fp32; None at first)
    previous_norm: torch.Tensor | None = None
    stepped_in_backward: bool = False  # overlap_step stepped every unit; `step()` settles it
    stepped_at: int = 0  # `micro` at the last step (or open/resume): a step needs new micro-batches

    def ends_step(self, accumulate: int) -> bool:
        """Whether the next backward is the last micro-batch of an optimizer step."""
        return (self.micro + 1) % accumulate == 0

    def between_steps(self, accumulate: int) -> bool:
        """Whether every micro-batch backpropagated belongs to a finished step."""
        return self.micro % accumulate == 0

    def step_due(self, accumulate: int) -> bool:
        """A global batch is complete and not stepped yet: a second `step()` does nothing."""
        return self.between_steps(accumulate) and self.micro != self.stepped_at

    def to_dict(self) -> dict[str, Any]:
        """The manifest's counters (a checkpoint sits between steps: `micro` is 0 on resume)."""
        previous = self.previous_norm
        return {
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
            "last_grad_norm": self.last_grad_norm,
            # a float32 tensor's value is exact as a Python float, and so survives JSON
            "previous_norm": None if previous is None else float(previous.item()),
        }

    def load(self, state: dict[str, Any]) -> None:
        """Take the counters of `to_dict` (KeyError/TypeError/ValueError when malformed)."""
        step_count, skipped = int(state["step_count"]), int(state["skipped_steps"])
        previous = state.get("previous_norm")
        self.previous_norm = (
            None if previous is None else torch.tensor(float(previous), dtype=torch.float32)
        )
        self.step_count, self.skipped_steps = step_count, skipped
        self.last_grad_norm = state.get("last_grad_norm")
        self.micro = self.stepped_at = 0
        self.stepped_in_backward = False
