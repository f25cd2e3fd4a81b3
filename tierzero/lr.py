"""The learning-rate schedule, shared by the reference trainer and the engine.

One function, so both compute the very same float for every step (bitwise equality of the
trained weights depends on it).
"""

from __future__ import annotations

import math

from tierzero.config import LRSchedule, OptimizerSettings


def lr_at(step: int, optimizer: OptimizerSettings) -> float:
    """The lr for optimizer update number `step` (0-based): linear warmup, then constant or
    cosine."""
    base = optimizer.lr
    if optimizer.warmup_steps and step < optimizer.warmup_steps:
        return base * (step + 1) / optimizer.warmup_steps
    if optimizer.lr_schedule is LRSchedule.CONSTANT or not optimizer.total_steps:
        return base
    span = max(1, optimizer.total_steps - optimizer.warmup_steps)
    progress = min(1.0, (step - optimizer.warmup_steps) / span)
    floor = base * optimizer.min_lr_ratio
    return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
