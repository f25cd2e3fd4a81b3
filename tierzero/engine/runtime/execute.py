"""Checkpointed unit execution: gather -> compute -> release, and recompute in backward.

Each unit's entry point is wrapped (a block's or the embedding's `forward`, the model's `head_out`);
a unit that uses another's weights (a head tied to the embedding) binds both. In a training forward
the block runs under `no_grad` with its parameters bound as views into the gathered flat `param`
buffer, and only its input is kept. In backward the unit is gathered again, recomputed with grad
(under the autocast state the forward ran with and the same seeded RNG draws,
`tierzero.models.draws`) against fresh leaf views of the flat buffer, and backpropagated; the
parameters' gradients are packed into one flat fp32 tensor, which goes to `on_grad`. Module code is
unchanged: it reads `self.weight` as usual. A unit in `UnitRunner.kept`
(`tierzero.planning.recompute`) runs its forward once, with grad, and keeps that graph until its
backward instead (`_KeptGraph`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from tierzero.engine.runtime.binding import bind, flat_grad, unbind
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
        self.kept: frozenset[int] = (
            frozenset()
        )  # units whose forward keeps its graph (`planning.recompute`)
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
        if unit.index in runner.kept and not unit.uses_with:
            with seeded(draws):
                ctx.kept = _KeptGraph.run(
                    runner, unit, _fill(flat_in, tensor_pos, tensors), spec, tensor_pos
                )
            out = tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, ctx.kept.out)
        else:
            ctx.save_for_backward(*tensors)
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
                *kept.backward(runner, unit, grads, ctx.out_tensor_idx),
            )
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in saved]
        bound = runner.bound_units(unit)
        leaves = [bind(u, runner.gather(u.index), requires_grad=True) for u in bound]
        try:
            with torch.enable_grad(), seeded(ctx.draws), autocast_as(ctx.autocast):
                args, kwargs = tree_unflatten(_fill(ctx.flat_in, ctx.tensor_pos, inputs), ctx.spec)
                out = runner.compute(unit, args, kwargs, leaves=leaves[0])
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


class _KeptGraph:
    """A unit's forward run once, with grad, its autograd graph kept until its backward: no
    recompute. The unit's gathered param buffer is released after the forward as usual (its
    device buffer goes back to the pool), so the graph must not hold its storage: every tensor
    autograd saves that is a view of the buffer (a weight a matmul needs for its input's grad)
    is saved as its place in the buffer (`_ParamViews`) and read in backward from the buffer
    gathered again there, as the swap plan gathers every unit in backward anyway. The values
    are those the forward read, so the gradients are the recompute's, bit for bit."""

    def __init__(
        self, inputs: list[torch.Tensor], leaves: list[torch.Tensor], out: Any, params: _ParamViews
    ) -> None:
        self.inputs, self.leaves, self.out, self.params = inputs, leaves, out, params

    @staticmethod
    def run(
        runner: UnitRunner, unit: Unit, flat_in: list, spec: Any, tensor_pos: list[int]
    ) -> _KeptGraph:
        inputs = [flat_in[i].detach().requires_grad_(flat_in[i].requires_grad) for i in tensor_pos]
        flat = runner.gather(unit.index)
        params = _ParamViews(flat)
        leaves = bind(unit, flat, requires_grad=True)
        try:
            with (
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(params.pack, params.unpack),
            ):
                args, kwargs = tree_unflatten(_fill(flat_in, tensor_pos, inputs), spec)
                out = runner.compute(unit, args, kwargs, leaves=leaves)
        finally:
            unbind(unit, runner.dtype, runner.device)
            runner.release(unit.index)
            params.flat = None
        return _KeptGraph(inputs, [_storageless(leaf) for leaf in leaves], out, params)

    def backward(
        self, runner: UnitRunner, unit: Unit, grads: tuple, out_idx: list[int]
    ) -> list[torch.Tensor | None]:
        """Backprop the kept graph against the unit's buffer gathered again; the inputs' grads.
        The modules are bound to it too: the loss's checkpointed chunks call the head again."""
        self.params.flat = runner.gather(unit.index)
        bind(unit, self.params.flat, requires_grad=True)
        try:
            outs = tree_flatten(self.out)[0]
            pairs = [
                (outs[i], grads[i])
                for i in out_idx
                if outs[i].requires_grad and grads[i] is not None
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            if unit.trainable_numel:
                runner.on_grad(unit.index, *flat_grad(unit, self.leaves))
        finally:
            unbind(unit, runner.dtype, runner.device)
            self.params.flat = None
            runner.release(unit.index)
        return [t.grad if t.requires_grad else None for t in self.inputs]


def _storageless(leaf: torch.Tensor) -> torch.Tensor:
    """`leaf` holding no part of the gathered buffer (with several ranks a buffer of its own,
    which the graph's grad accumulators would otherwise keep alive until backward): one element
    broadcast to its shape. Autograd reads a leaf's metadata only, and a gradient's values do
    not depend on its layout; a frozen parameter (no leaf) is dropped for a placeholder."""
    if not leaf.requires_grad:
        return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
    leaf.data = torch.zeros((), dtype=leaf.dtype, device=leaf.device).expand(leaf.shape)
    return leaf


class _ParamViews:
    """Saved-tensor hooks that save a view of the unit's param buffer by its place in it."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat: torch.Tensor | None = flat
        self.ptr, self.start, self.end = (
            flat.untyped_storage().data_ptr(),
            flat.storage_offset(),
            flat.storage_offset() + flat.numel(),
        )
        self.dtype, self.device = flat.dtype, flat.device

    def pack(self, t: torch.Tensor) -> Any:
        if (
            t.dtype == self.dtype
            and t.device == self.device
            and t.untyped_storage().data_ptr() == self.ptr
            and self.start <= t.storage_offset() < self.end
        ):
            return _ParamView(t.storage_offset() - self.start, tuple(t.shape), t.stride())
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
