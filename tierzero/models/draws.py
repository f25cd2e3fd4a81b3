"""The random numbers a unit's call draws (dropout masks), from a state that depends only on
(seed, step, micro-batch, unit).

Horizontally a step runs micro-batch after micro-batch through every unit; vertically
(`tierzero.engine.vertical.schedule`) unit after unit over every micro-batch. A single RNG stream
drawn in call order would give the two schedules different masks, so each unit's call of each
micro-batch draws from its own seeded generator state instead (`seeded`), in its forward and again
in its recompute, and puts the stream it replaced back afterwards: the masks are the same in either
schedule, after a resume, and in the reference trainer (`SeededEntries`), which so stays the oracle
for models with dropout. Parameter-free code outside the units (a root unit, a model's own forward
between calls) draws from torch's ordinary stream.

On a GPU the generator of each device the call's inputs are on is seeded by its index:
recompute runs on autograd's thread for that GPU, whose current device need not be the
training thread's (`torch.cuda.manual_seed` alone seeds the current device's generator).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tierzero.errors import ConfigError
from tierzero.layout.partition import partition


@dataclass(frozen=True)
class Draws:
    """One unit call's generator seed and the GPUs whose generators it seeds."""

    seed: int
    devices: tuple[torch.device, ...] = ()


def draw_seed(seed: int, step: int, micro: int, unit: int) -> int:
    """A well-mixed 63-bit seed for unit `unit` of micro-batch `micro` (within the step) of step
    `step`."""
    return int(
        np.random.SeedSequence([seed, step, micro, unit]).generate_state(1, np.uint64)[0]
        >> np.uint64(1)
    )


def draws_for(seed: int, step: int, micro: int, unit: int, inputs: Any) -> Draws:
    """The draws of one unit call whose inputs (any nesting of tensors) are `inputs`."""
    devices = sorted(
        {t.device for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.is_cuda},
        key=str,
    )
    return Draws(draw_seed(seed, step, micro, unit), tuple(devices))


class seeded:
    """Run under `draws` (the CPU generator and those of its GPUs seeded), then put back the
    states it replaced."""

    def __init__(self, draws: Draws) -> None:
        self.draws = draws

    def __enter__(self) -> None:
        gpus = self.draws.devices
        self.saved = torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in gpus}
        torch.default_generator.manual_seed(self.draws.seed)
        for device in gpus:
            torch.cuda.default_generators[device.index].manual_seed(self.draws.seed)

    def __exit__(self, *exc: object) -> None:
        cpu, gpus = self.saved
        torch.set_rng_state(cpu)
        for device, state in gpus.items():
            torch.cuda.set_rng_state(state, device)


class SeededEntries:
    """The reference trainer's side: every unit's entry point (`tierzero.layout.partition`) of
    an in-memory model called under the draws the engine gives that call; `position()` says
    (step, micro-batch within the step) of the forward under way."""

    def __init__(
        self,
        entries: list[tuple[int, Any, str]],
        seed: int,
        position: Callable[[], tuple[int, int]],
    ) -> None:
        self.seed = seed
        self.position = position
        for index, owner, attr in entries:
            setattr(owner, attr, functools.partial(self._call, index, getattr(owner, attr)))

    def _call(self, unit: int, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: no dropout to match
            return original(*args, **kwargs)
        step, micro = self.position()
        with seeded(draws_for(self.seed, step, micro, unit, (args, kwargs))):
            return original(*args, **kwargs)


def unit_entries(model: nn.Module) -> list[tuple[int, Any, str]]:
    """(unit index, owner, attribute) of each unit's entry point of `model`; none when it has
    no blocks to split (then every draw comes from torch's ordinary stream)."""
    try:
        units = partition(model)
    except ConfigError:
        return []
    return [(u.index, *u.entry) for u in units if u.entry is not None]
