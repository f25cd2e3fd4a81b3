"""Kept graphs: a unit's forward run once, with grad, its autograd graph held until its backward
instead of being recomputed there (`tierzero.planning.recompute` chooses which units), and what
such a graph holds, counted as autograd saves it.

The unit's gathered param buffer is released after the forward as usual (its device buffer
goes back to the pool), so a graph must not hold its storage: every tensor autograd saves that
is a view of the buffer (a weight a matmul needs for its input's grad) is saved as its place in
the buffer (`SavedTensors`) and read in backward from the buffer gathered again there, as the
swap plan gathers every unit in backward anyway. The values are those the forward read, so the
gradients are the recompute's, bit for bit.

The same hooks count every other storage a call saves, the call's inputs aside (they are
counted where they wait: as checkpoints, or in the vertical schedule's store). For a model whose
shape says nothing of its activations (a Hugging Face decoder, dense or a mixture of experts)
that count, taken on the first step's recomputes (`Keeping.measuring`), is what each unit's
graph would hold; the engine chooses the kept units from it after that step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten

from tierzero.engine.runtime.binding import bind, flat_grad, unbind
from tierzero.layout.partition import Unit


class Keeping:
    """Which units keep their graph, for which micro-batches, and what the first step's
    recomputes measured. A choice holds for micro-batches of at most `tokens` tokens (the batch
    it was sized for): a larger one recomputes every unit, as its graphs would not fit."""

    # a unit's backward beside its recompute's saved tensors: its output's and input's grads and
    # a temporary or two (under a quarter of a built-in block's saved bytes), counted as a half
    BACKWARD_SHARE = 0.5

    def __init__(self) -> None:
        self.units: frozenset[int] = frozenset()
        self.tokens: int | None = None  # the largest micro-batch the choice holds for
        self.on = True  # this micro-batch keeps the chosen units' graphs
        self.measuring = False  # the recomputes count what they save (`measured`)
        self.measured: dict[int, int] = {}  # unit -> bytes one of its graphs holds, at most
        self.seen = 0  # the largest micro-batch measured, in tokens
        self.checkpoint_bytes = 0  # a measured micro-batch's checkpointed inputs, at most
        self._checkpoints = 0  # this micro-batch's so far

    def choose(self, units: frozenset[int], tokens: int | None) -> None:
        self.units, self.tokens, self.measuring = units, tokens, False

    def start(self, tokens: int) -> None:
        """A training micro-batch of `tokens` tokens begins."""
        self.on = self.tokens is None or tokens <= self.tokens
        if self.measuring:
            self.seen, self._checkpoints = max(self.seen, tokens), 0

    def keeps(self, unit: Unit) -> bool:
        return self.on and unit.index in self.units and not unit.uses_with

    def measure(self, unit: Unit, saved: SavedTensors, held: int = 0) -> None:
        """`unit`'s recompute saved what `saved` counted; a kept graph would hold `held` bytes
        more (vertically: its input)."""
        nbytes = saved.nbytes + held
        self.measured[unit.index] = max(self.measured.get(unit.index, 0), nbytes)

    def checkpointed(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self._checkpoints += sum(t.nbytes for t in tensors)
        self.checkpoint_bytes = max(self.checkpoint_bytes, self._checkpoints)

    def sizes(self, vertical: int) -> dict[int, int]:
        """What each measured unit's kept graphs would hold: vertically, one per micro-batch."""
        return {i: max(1, vertical) * n for i, n in self.measured.items()}

    def working(self, vertical: int) -> int:
        """The step's activations beside kept graphs: the checkpoints (horizontally; vertically
        they wait in the host store) and the largest unit's recompute and backward."""
        largest = max(self.measured.values(), default=0)
        return (0 if vertical else self.checkpoint_bytes) + int(largest * (1 + self.BACKWARD_SHARE))


class SavedTensors:
    """Saved-tensor hooks over one call of a unit on its param buffer `flat`: a view of the
    buffer is saved by its place in it, and every other storage saved is counted (`nbytes`),
    but those of `inputs`."""

    def __init__(self, flat: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        self.flat: torch.Tensor | None = flat
        self.ptr, self.start, self.end = (
            flat.untyped_storage().data_ptr(),
            flat.storage_offset(),
            flat.storage_offset() + flat.numel(),
        )
        self.dtype, self.device = flat.dtype, flat.device
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.storages: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if (
            t.dtype == self.dtype
            and t.device == self.device
            and ptr == self.ptr
            and self.start <= t.storage_offset() < self.end
        ):
            return _ParamView(t.storage_offset() - self.start, tuple(t.shape), t.stride())
        if ptr not in self.inputs:
            self.storages[ptr] = t.untyped_storage().nbytes()
        return t

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _ParamView):
            return saved
        assert self.flat is not None, "a kept graph's params are read in its backward only"
        return self.flat.as_strided(
            saved.shape, saved.stride, self.flat.storage_offset() + saved.offset
        )


class _ParamView(NamedTuple):
    offset: int  # elements from the start of the unit's param buffer
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class KeptGraph:
    """One call of a unit, its graph kept: its inputs (leaves), its params' leaves (holding no
    storage), its output and the hooks that read its params back."""

    def __init__(
        self, inputs: list[torch.Tensor], leaves: list[torch.Tensor], out: Any, saved: SavedTensors
    ) -> None:
        self.inputs, self.leaves, self.out, self.saved = inputs, leaves, out, saved

    @staticmethod
    def record(
        unit: Unit,
        flat: torch.Tensor,
        inputs: list[torch.Tensor],
        forward: Callable[[list[torch.Tensor]], Any],
        dtype: torch.dtype,
        device: torch.device,
    ) -> KeptGraph:
        """Run `forward(leaves)` with grad on `unit` bound to `flat` (fresh leaves: each graph
        has its own, so its grad is its call's alone), on `inputs` that are leaves already."""
        saved = SavedTensors(flat, inputs)
        leaves = bind(unit, flat, requires_grad=True)
        try:
            with torch.enable_grad(), saved.hooks():
                out = forward(leaves)
        finally:
            unbind(unit, dtype, device)
            saved.flat = None
        return KeptGraph(inputs, [_storageless(leaf) for leaf in leaves], out, saved)

    def backprop(
        self, unit: Unit, flat: torch.Tensor, grads: tuple, out_idx: list[int]
    ) -> tuple[tuple[torch.Tensor, frozenset[int]] | None, list[torch.Tensor | None]]:
        """Backprop the graph against `flat`, the unit's buffer gathered again: the unit's
        flat grad (None: nothing trainable) and the inputs' grads."""
        self.saved.flat = flat
        try:
            outs = tree_flatten(self.out)[0]
            pairs = [
                (outs[i], grads[i])
                for i in out_idx
                if outs[i].requires_grad and grads[i] is not None
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grad = flat_grad(unit, self.leaves) if unit.trainable_numel else None
        finally:
            self.saved.flat = None
        return grad, [t.grad if t.requires_grad else None for t in self.inputs]


def _storageless(leaf: torch.Tensor) -> torch.Tensor:
    """`leaf` holding no part of the gathered buffer (with several ranks a buffer of its own,
    which the graph's grad accumulators would otherwise keep alive until backward): one element
    broadcast to its shape. Autograd reads a leaf's metadata only, and a gradient's values do
    not depend on its layout; a frozen parameter (no leaf) is dropped for a placeholder."""
    if not leaf.requires_grad:
        return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
    leaf.data = torch.zeros((), dtype=leaf.dtype, device=leaf.device).expand(leaf.shape)
    return leaf


def batch_tokens(batch: Any) -> int:
    """A micro-batch's size as kept graphs scale with it: its token ids' count (its largest
    integer tensor), else its largest tensor's elements."""
    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    ids = [t for t in tensors if not t.is_floating_point()] or tensors
    return max((t.numel() for t in ids), default=0)
