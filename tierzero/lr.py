"""The learning-rate schedule, shared by the reference trainer and the engine.

One function, so both compute the very same float for every step (bitwise equality of the
trained weights depends on it).
"""

from __future__ import annotations

import math

from tierzero.config import Config, LRSchedule


def lr_at(step: int, config: Config) -> float:
    """The lr for optimizer update number `step` (0-based): linear warmup, then constant or cosine."""
    base = config.lr
    if config.warmup_steps and step < config.warmup_steps:
        return base * (step + 1) / config.warmup_steps
    if config.lr_schedule is LRSchedule.CONSTANT or not config.total_steps:
        return base
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = base * config.min_lr_ratio
    return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
