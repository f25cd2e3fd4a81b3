"""Full current weights for user code (`Engine.gathered`), and their gradients' way back.

Inside `with engine.gathered(names) as weights:` user code reads the full value of every
parameter named (all by default; tied aliases share one tensor): a copy on the compute device
in the compute dtype, read from the param shards' homes. A trainable parameter's copy is an
autograd leaf, so a custom loss or a regulariser on the weights can be differentiated:
`engine.backward(loss)` inside the block first takes the gradient of the scaled loss with
respect to these leaves alone (`torch.autograd.grad` on the graph that leads to them, which
reaches no unit), packs it per unit like a unit's own flat gradient, and `GradShards` adds it
to that unit's gradient from backward before accumulating it: the two terms plain autograd
sums for a parameter used in the model and in the regulariser, so the result is the same.

Changing a copy changes nothing in the engine. The copies are torch allocations beside the
pools (the memory model does not count them): ask for the names you need. On exit the block's
dict is cleared; a copy the caller still holds stays valid as a value, but a backward whose
loss reaches it is refused (its gradient would be lost) before anything is accumulated.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit

UnitGrad = tuple[torch.Tensor, frozenset[int]]  # a unit's flat fp32 grad, the slots that got one


@dataclass(frozen=True)
class GatheredWeight:
    """One parameter's full copy and where it lives (its unit and slot)."""

    unit: int
    slot: int
    tensor: torch.Tensor


def resolve(units: list[Unit], names: Iterable[str] | None) -> dict[str, tuple[int, int]]:
    """Parameter name -> (unit, slot) for `names` (every name when None), or a clear error."""
    index = {
        name: (u.index, i) for u in units for i, slot in enumerate(u.slots) for name in slot.names
    }
    if names is None:
        return index
    wanted = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in wanted if n not in index]
    if unknown:
        raise ConfigError(
            f"'{unknown[0]}' is not a parameter of the model; pass names as "
            "model.named_parameters() lists them (or none, for every parameter)"
        )
    return {n: index[n] for n in wanted}


def copies(
    units: list[Unit], where: dict[str, tuple[int, int]], flat_of
) -> dict[str, GatheredWeight]:
    """Each named parameter's copy, cut from its unit's full flat param (`flat_of(unit)`, read
    once per unit); trainable ones are leaves that require grad."""
    out: dict[str, GatheredWeight] = {}
    by_slot: dict[tuple[int, int], GatheredWeight] = {}
    for unit_index in sorted({u for u, _ in where.values()}):
        unit = units[unit_index]
        flat = flat_of(unit)
        for i, slot in enumerate(unit.slots):
            if any(where.get(n) == (unit_index, i) for n in slot.names):
                tensor = flat[slot.offset : slot.end].view(slot.shape).clone()
                by_slot[(unit_index, i)] = GatheredWeight(
                    unit_index, i, tensor.requires_grad_(not slot.frozen)
                )
    for name, key in where.items():
        out[name] = by_slot[key]
    return out


def unit_grads(
    units: list[Unit], weights: list[GatheredWeight], grads: list[torch.Tensor | None]
) -> dict[int, UnitGrad]:
    """The gradients that reached the copies, as one flat fp32 buffer per unit laid out as
    `execute.flat_grad` lays out a unit's own (the trainable prefix; several ranks: the padded
    flat), with the slots they cover."""
    out: dict[int, UnitGrad] = {}
    for weight, grad in zip(weights, grads):
        if grad is None:
            continue
        unit = units[weight.unit]
        if weight.unit not in out:
            numel = unit.trainable_numel if unit.world_size == 1 else unit.padded_numel
            out[weight.unit] = (
                torch.zeros(numel, dtype=torch.float32, device=grad.device),
                frozenset(),
            )
        flat, present = out[weight.unit]
        slot = unit.slots[weight.slot]
        flat[slot.offset : slot.end].copy_(grad.reshape(-1))
        out[weight.unit] = (flat, present | {weight.slot})
    return out


class GatheredBlocks:
    """The open `gathered` blocks and the trainable copies of closed ones, for one engine."""

    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        self._open: list[dict[str, GatheredWeight]] = []
        # trainable copies of closed blocks, by id (tensors do not hash by identity)
        self._closed: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    @contextlib.contextmanager
    def block(self, weights: dict[str, GatheredWeight]) -> Iterator[dict[str, torch.Tensor]]:
        """`weights` open for user code as name -> tensor; cleared on exit."""
        self._open.append(weights)
        view = {name: w.tensor for name, w in weights.items()}
        try:
            yield view
        finally:
            self._open.remove(weights)
            self._closed.update(
                {id(w.tensor): w.tensor for w in weights.values() if w.tensor.requires_grad}
            )
            view.clear()

    def grads(self, scaled: torch.Tensor) -> dict[int, UnitGrad]:
        """The gradients of `scaled` with respect to the open blocks' trainable copies, per unit
        (taken before backward, so each unit's is added to its own as it arrives)."""
        leaves = list(
            {
                id(w.tensor): w
                for block in self._open
                for w in block.values()
                if w.tensor.requires_grad
            }.values()
        )
        if not leaves or not scaled.requires_grad:
            return {}
        grads = torch.autograd.grad(
            scaled, [w.tensor for w in leaves], retain_graph=True, allow_unused=True
        )
        return unit_grads(self.units, leaves, list(grads))

    def refuse_closed(self, loss: torch.Tensor) -> None:
        """A gradient that would reach a copy after its block closed would be lost: refuse that
        backward before anything is accumulated (the engine stays usable)."""
        open_ = {id(w.tensor) for block in self._open for w in block.values()}
        stale = [t for key, t in list(self._closed.items()) if key not in open_ and t.requires_grad]
        if not stale or not loss.requires_grad:
            return
        reached = torch.autograd.grad(loss, stale, retain_graph=True, allow_unused=True)
        if any(g is not None for g in reached):
            raise ConfigError(
                "this loss uses weights from an `engine.gathered` block that has closed, "
                "so their gradients would be lost; call engine.backward(loss) inside the block"
            )
