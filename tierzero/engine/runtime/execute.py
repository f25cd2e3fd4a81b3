"""Checkpointed unit execution: gather -> compute -> release, and recompute in backward.

Each unit's entry point is wrapped (a block's or the embedding's `forward`, the model's `head_out`);
a unit that uses another's weights (a head tied to the embedding) binds both. In a training forward
the block runs under `no_grad` with its parameters bound as views into the gathered flat `param`
buffer, and only its input is kept. In backward the unit is gathered again, recomputed with grad
(under the autocast state the forward ran with and the same seeded RNG draws,
`tierzero.models.draws`) against fresh leaf views of the flat buffer, and backpropagated; the
parameters' gradients are packed into one flat fp32 tensor, which goes to `on_grad`. Module code is
unchanged: it reads `self.weight` as usual. A unit that `UnitRunner.keeping` keeps
(`tierzero.planning.recompute`) runs its forward once, with grad, and keeps that graph until its
backward instead (`tierzero.engine.runtime.kept`); on a model whose shape says nothing of its
activations, the first step's recomputes measure what each unit's graph would hold."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from tierzero.engine.runtime.binding import bind, flat_grad, unbind
from tierzero.engine.runtime.kept import Keeping, KeptGraph, SavedTensors
from tierzero.engine.step.backward import BackwardPass
from tierzero.layout.partition import Unit
from tierzero.models.draws import Draws, draws_for, seeded

GatherFn = Callable[[int], torch.Tensor]  # unit index -> full flat param buffer on the device
ReleaseFn = Callable[[int], None]
GradFn = Callable[
    [int, torch.Tensor, frozenset[int]], None
]  # unit index, flat grad, slots with a grad


class UnitRunner:
    """Installs the checkpointed entry point of every unit that has one (all but a root)."""

    def __init__(
        self,
        units: list[Unit],
        gather: GatherFn,
        release: ReleaseFn,
        on_grad: GradFn,
        dtype: torch.dtype,
        device: torch.device,
        forward_only: frozenset[int] = frozenset(),
        seed: int = 0,
    ) -> None:
        self.units = units
        self.seed = seed
        self.position = (0, 0)  # (step, micro-batch within it) of the training forward under way
        self.held: set[int] = set()  # units the vertical schedule has bound: their entry runs as is
        self.gather = gather
        self.release = release
        self.on_grad = on_grad
        self.dtype = dtype
        self.device = device  # where unbound parameters say they are (`binding.Unbound`)
        self.forward_only = forward_only  # units run without a backward (`partition.forward_only`)
        self.keeping = Keeping()  # units whose forward keeps its graph (`runtime.kept`)
        self._originals: dict[int, Callable[..., Any]] = {}
        self._shadowed: set[int] = set()  # entries that were instance attributes already
        self.pass_ = BackwardPass()  # the backward in progress (`running`)
        self._anchor = torch.empty(0, requires_grad=True)

    def install(self) -> None:
        for unit in self.units:
            if unit.entry is not None:
                owner, attr = unit.entry
                if attr in vars(owner):
                    self._shadowed.add(unit.index)
                self._originals[unit.index] = getattr(owner, attr)
                setattr(owner, attr, functools.partial(self._run, unit))

    def uninstall(self) -> None:
        for unit in self.units:
            if unit.index in self._originals:
                owner, attr = unit.entry
                original = self._originals.pop(unit.index)
                if unit.index in self._shadowed:
                    setattr(owner, attr, original)
                else:
                    delattr(owner, attr)  # the class's own method shows through again
        self._shadowed.clear()

    @contextlib.contextmanager
    def running(self, pass_: BackwardPass) -> Iterator[None]:
        """Run the units' backward as part of `pass_` (which may read optimizer states ahead)."""
        self.pass_ = pass_
        try:
            yield
        finally:
            self.pass_ = BackwardPass()

    def bound_units(self, unit: Unit) -> list[Unit]:
        """The units a call of `unit` binds, in the order the swap plan waits for them."""
        return [unit, *(self.units[v] for v in unit.uses_with)]

    def draws(self, unit: int, inputs: Any, micro: int | None = None) -> Draws:
        """What unit `unit`'s call on `inputs` draws, for micro-batch `micro` of this step
        (default: the one under way)."""
        step, current = self.position
        return draws_for(self.seed, step, current if micro is None else micro, unit, inputs)

    @contextlib.contextmanager
    def holding(self, unit: Unit) -> Iterator[None]:
        """Inside, a call of `unit`'s entry runs its own forward on the weights its caller bound."""
        self.held.add(unit.index)
        try:
            yield
        finally:
            self.held.discard(unit.index)

    def _run(self, unit: Unit, *args: Any, **kwargs: Any) -> Any:
        if unit.index in self.held:
            return self._originals[unit.index](*args, **kwargs)
        if not torch.is_grad_enabled():
            return self.compute(unit, args, kwargs)
        draws = self.draws(unit.index, (args, kwargs))
        if unit.index in self.forward_only:
            with seeded(draws):
                return self.compute(unit, args, kwargs)
        flat_in, spec = tree_flatten((args, kwargs))
        tensor_pos = [i for i, a in enumerate(flat_in) if isinstance(a, torch.Tensor)]
        # the anchor requires grad, so backward reaches this unit even when no input does
        outs = _Checkpointed.apply(
            self,
            unit,
            flat_in,
            spec,
            tensor_pos,
            self._anchor,
            draws,
            *[flat_in[i] for i in tensor_pos],
        )
        return tree_unflatten(list(outs[:-1]), outs[-1]) if isinstance(outs, tuple) else outs

    def compute(
        self, unit: Unit, args: tuple, kwargs: dict, leaves: list[torch.Tensor] | None = None
    ) -> Any:
        """Gather, bind, run the block's own forward, unbind, release — or, given `leaves`
        (already bound by the caller), just run it: the caller unbinds only after its backward,
        which may call the modules again (the loss's checkpointed chunks recompute the head)."""
        if leaves is not None:
            return self._originals[unit.index](*args, **kwargs)
        bound = self.bound_units(unit)
        for u in bound:
            bind(u, self.gather(u.index))
        try:
            return self._originals[unit.index](*args, **kwargs)
        finally:
            for u in bound:
                unbind(u, self.dtype, self.device)
            self.release(unit.index)


class _Checkpointed(torch.autograd.Function):
    """Keeps only the unit's inputs; backward regathers, recomputes, and backprops."""

    @staticmethod
    def forward(
        ctx: Any,
        runner: UnitRunner,
        unit: Unit,
        flat_in: list,
        spec: Any,
        tensor_pos: list[int],
        anchor: torch.Tensor,
        draws: Draws,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.runner, ctx.unit, ctx.flat_in, ctx.spec, ctx.tensor_pos = (
            runner,
            unit,
            flat_in,
            spec,
            tensor_pos,
        )
        ctx.kept = None
        if runner.keeping.keeps(unit):
            with seeded(draws):
                ctx.kept = _keep(runner, unit, flat_in, spec, tensor_pos, tensors)
            out = tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, ctx.kept.out)
        else:
            ctx.save_for_backward(*tensors)
            if runner.keeping.measuring:
                runner.keeping.checkpointed(tensors)
            ctx.draws = draws
            ctx.autocast = autocast_state(tensors)
            with torch.no_grad(), seeded(draws):
                args, kwargs = tree_unflatten(_fill(flat_in, tensor_pos, tensors), spec)
                out = runner.compute(unit, args, kwargs)
        out_flat, out_spec = tree_flatten(out)
        ctx.out_tensor_idx = [i for i, o in enumerate(out_flat) if isinstance(o, torch.Tensor)]
        if isinstance(out, torch.Tensor):
            return out
        # autograd returns tensors only; the output structure travels as the last element
        return (*out_flat, out_spec)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        runner, unit = ctx.runner, ctx.unit
        runner.pass_.unit_starting(unit.index)
        if ctx.kept is not None:
            kept, ctx.kept = ctx.kept, None
            return (
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                *_backprop(runner, unit, kept, grads, ctx),
            )
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in saved]
        bound = runner.bound_units(unit)
        flats = [runner.gather(u.index) for u in bound]
        leaves = [bind(u, flat, requires_grad=True) for u, flat in zip(bound, flats)]
        saved = SavedTensors(flats[0], inputs) if runner.keeping.measuring else None
        try:
            with (
                torch.enable_grad(),
                seeded(ctx.draws),
                autocast_as(ctx.autocast),
                saved.hooks() if saved else contextlib.nullcontext(),
            ):
                args, kwargs = tree_unflatten(_fill(ctx.flat_in, ctx.tensor_pos, inputs), ctx.spec)
                out = runner.compute(unit, args, kwargs, leaves=leaves[0])
            if saved is not None:
                runner.keeping.measure(unit, saved)
            outs = tree_flatten(out)[0]
            pairs = [
                (outs[i], grads[i])
                for i in ctx.out_tensor_idx
                if outs[i].requires_grad and grads[i] is not None
            ]
            if pairs:  # none when every weight is frozen and no input needs a grad
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            for u, unit_leaves in zip(bound, leaves):
                if u.trainable_numel:  # a unit of frozen parameters only has no grad to store
                    runner.on_grad(u.index, *flat_grad(u, unit_leaves))
        finally:
            for u in bound:
                unbind(u, runner.dtype, runner.device)
            runner.release(unit.index)
        return (
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            *[t.grad if t.requires_grad else None for t in inputs],
        )


def _keep(
    runner: UnitRunner, unit: Unit, flat_in: list, spec: Any, tensor_pos: list[int], tensors: tuple
) -> KeptGraph:
    """Run `unit`'s forward once, its graph kept (`runtime.kept`), on its buffer gathered for
    the call."""
    inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
    args, kwargs = tree_unflatten(_fill(flat_in, tensor_pos, inputs), spec)
    try:
        return KeptGraph.record(
            unit,
            runner.gather(unit.index),
            inputs,
            lambda leaves: runner.compute(unit, args, kwargs, leaves=leaves),
            runner.dtype,
            runner.device,
        )
    finally:
        runner.release(unit.index)


def _backprop(
    runner: UnitRunner, unit: Unit, kept: KeptGraph, grads: tuple, ctx: Any
) -> list[torch.Tensor | None]:
    """Backprop `kept` against the unit's buffer gathered again, its grad to `on_grad`; the
    inputs' grads. The modules are bound to it too: the loss's checkpointed chunks call the
    head again."""
    flat = runner.gather(unit.index)
    bind(unit, flat, requires_grad=True)
    try:
        grad, input_grads = kept.backprop(unit, flat, grads, ctx.out_tensor_idx)
        if grad is not None:
            runner.on_grad(unit.index, *grad)
    finally:
        unbind(unit, runner.dtype, runner.device)
        runner.release(unit.index)
    return input_grads


def _fill(flat_in: list, positions: list[int], tensors: Any) -> list:
    filled = list(flat_in)
    for i, t in zip(positions, tensors):
        filled[i] = t
    return filled


AutocastState = tuple[tuple[tuple[str, bool, torch.dtype], ...], bool]


def autocast_state(tensors: tuple) -> AutocastState:
    """Autocast as the forward ran, for the CPU and the inputs' device type (a forward under
    `torch.autocast` must be recomputed under it, or backward differentiates other numerics)."""
    types = sorted({"cpu", *(t.device.type for t in tensors)})
    return (
        tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types),
        torch.is_autocast_cache_enabled(),
    )


def autocast_as(state: AutocastState) -> contextlib.ExitStack:
    per_device, cache = state
    stack = contextlib.ExitStack()
    for device_type, enabled, dtype in per_device:
        stack.enter_context(
            torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache)
        )
    return stack
