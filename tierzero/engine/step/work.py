"""`Work`: one piece of one unit's optimizer shards on its way through a step: its range, the
tensors it is stepped in, the buffers it leased and the transfers and events it waits for."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tierzero.config import StateKind
from tierzero.engine.runtime.streams import Event
from tierzero.engine.step.skipped import Run
from tierzero.layout.partition import Unit


@dataclass
class Work:
    """One piece of one unit's optimizer shards on the stepping device, and which are borrowed."""

    unit: Unit
    piece: int
    start: int  # the piece's range in the shard
    end: int
    runs: list[Run] = field(default_factory=list)  # the unit's runs to update (`SkippedSteps.runs`)
    tensors: dict[StateKind, torch.Tensor] = field(default_factory=dict)
    leased: dict[StateKind, torch.Tensor] = field(default_factory=dict)  # kind -> leased buffer
    futures: list = field(default_factory=list)
    grad_landed: Event = (
        None  # the D2H copy of its grad piece (overlap_step), waited for by `Tiers.landed`
    )
    produced: Event = (
        None  # overlap_step: after it the grad is final, the params no more read in the pass
    )
    copies: dict[StateKind, Event] = field(
        default_factory=dict
    )  # leased buffers read by h2d_write copies
    # a step on the device (`Placement.optimizer`): host buffers nvme reads and writes and new
    # params pass through, the step's compute event, and the new params' copy down
    staging: dict[StateKind, torch.Tensor] = field(default_factory=dict)
    stepped: Event = None
    param_down: Event = None

    @property
    def numel(self) -> int:
        return self.end - self.start
