"""The vertical (layer-major) schedule of gradient accumulation: each unit runs all k micro-batches
of a step before the next unit does.

Horizontally (the default) every micro-batch goes forward and backward through every unit, so
with params on NVMe each extra micro-batch reads every param twice more, and each unit's fp32
grad is read back and written again. Vertically the engine drives the model's chain of units
itself -- the embedding, each block, the head -- so per step each unit's params are fetched
once for the forward and once for the backward (with several ranks: gathered once per pass),
and its grad is summed over the k micro-batches on the compute device and reduced and stored
once. The swap plan says so as data (`planning.swapplan`, `micro_batches`).

Exactness. A micro-batch's unit runs the same code on the same inputs as horizontally, and its
grad is added in the same fp32 arithmetic in micro-batch order (a tied embedding's two uses
first summed per micro-batch, as autograd sums them); so fp32 on one rank is bitwise equal to
horizontal and to plain PyTorch. The head computes each micro-batch's loss inside its backward
use (no separate forward), from the same ops. What cannot be matched is the RNG's order: each
(micro-batch, unit) recomputes under the RNG state its forward had, but the forward draws in
unit-major order, so a model with dropout gets other (equally valid) masks than horizontally;
`auto` keeps such models horizontal. The built-in models have no dropout.

What waits. Each micro-batch's input to each block waits from the block's forward to its
backward in a `BoundaryStore` (host memory under a budget, spilled to NVMe); the last block's
outputs stay on the device for the head, and the gradients flowing back between units are k
activation-sized tensors on the device. A tied embedding's grads from the head wait in the
store too, until the embedding's own backward adds them micro-batch by micro-batch.

Which models. A chain: the built-in LLaMA family, whose forward is exactly
`head_out(blocks(tok_emb(ids)), targets)` on a batch `(ids, targets)`; anything else is refused
(or, with `auto`, run horizontally).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tierzero.config import Config, Recompute, Schedule, StateKind, Tier
from tierzero.engine.backward import BackwardPass
from tierzero.engine.boundary import BoundaryStore
from tierzero.engine.execute import (UnitRunner, autocast_as, autocast_state, bind, flat_grad, restore_rng,
                                     rng_state, unbind)
from tierzero.engine.grads import GradShards
from tierzero.errors import ConfigError, TierzeroError
from tierzero.layout.partition import Unit, forward_only
from tierzero.models.llama import Transformer
from tierzero.planning.memory_model import waiting_activations_bytes

Batch = tuple[torch.Tensor, torch.Tensor]  # token ids, targets


def not_a_chain(model: nn.Module, units: list[Unit]) -> str | None:
    """Why the vertical schedule cannot drive `model` (None: it can)."""
    if not isinstance(model, Transformer) or type(model).forward is not Transformer.forward:
        return f"{type(model).__name__} is not the built-in model, whose forward the engine can run unit by unit"
    if units[0].kind != "embedding" or units[-1].kind != "head":
        return "its units are not an embedding, blocks and a head"
    return None


def has_dropout(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def waiting_bytes(model: Transformer, batch: Batch, accumulate: int, itemsize: int) -> int:
    """Host bytes the vertical schedule's waiting activations take at most (the memory model's count)."""
    args = model.args
    return waiting_activations_bytes(args.n_layers, args.dim, args.vocab_size, model.head.weight is model.tok_emb.weight,
                                     batch[0].numel(), accumulate, itemsize)


def choose(config: Config, model: nn.Module, units: list[Unit], batch: Any, spill: bool,
           fits: Callable[[int], bool], itemsize: int) -> bool:
    """Whether this engine runs its steps vertically (decided at the first training step)."""
    if config.schedule is Schedule.HORIZONTAL or (config.schedule is Schedule.AUTO and config.accumulate == 1):
        return False
    why = not_a_chain(model, units)
    if why is None and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        why = "its batches are not (token ids, targets) pairs"
    if config.schedule is Schedule.VERTICAL:
        if why is not None:
            raise ConfigError(f"--schedule vertical needs a chain of units, but {why}; use --schedule horizontal")
        return True
    if why is not None or has_dropout(model) or config.recompute is Recompute.NONE:  # none keeps graphs: horizontal
        return False
    return spill or fits(waiting_bytes(model, tuple(batch), config.accumulate, itemsize))


class VerticalSchedule:
    """Runs one step's micro-batches unit by unit (see the module docstring)."""

    def __init__(self, model: Transformer, units: list[Unit], runner: UnitRunner, grads: GradShards,
                 store: BoundaryStore, dtype: torch.dtype, forward_only: frozenset[int]) -> None:
        self.model = model
        self.units = units
        self.runner = runner
        self.grads = grads
        self.store = store
        self.dtype = dtype
        self.forward_only = forward_only
        self._rng: dict[tuple[int, int], tuple[Any, Any]] = {}

    def run(self, batches: list[Batch], pass_: BackwardPass, loss_scale: float) -> list[torch.Tensor]:
        """Forward and backward every micro-batch of one step; their losses (detached)."""
        for ids, _ in batches:
            if ids.shape[1] > self.model.args.max_seq_len:
                raise ConfigError(f"sequence length {ids.shape[1]} exceeds the model's max_seq_len "
                                  f"{self.model.args.max_seq_len}; use a shorter --seq-len")
        try:
            last = self._forward([ids for ids, _ in batches])
            return self._backward(batches, last, pass_, loss_scale)
        except BaseException:
            self.store.clear()
            raise
        finally:
            self._rng.clear()

    def _forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The embedding and the blocks, each over every micro-batch with one fetch; the last
        block's outputs (the head's inputs)."""
        xs = list(xs)
        for unit in self.units[:-1]:
            bind(unit, self.runner.gather(unit.index))
            try:
                for m, x in enumerate(xs):
                    if unit.kind == "block":
                        self.store.put(unit.index, m, x)
                    self._rng[unit.index, m] = rng_state((x,)), autocast_state((x,))
                    with torch.no_grad():
                        xs[m] = self._call(unit, x)
            finally:
                unbind(unit, self.dtype)
                self.runner.release(unit.index)
        return xs

    def _backward(self, batches: list[Batch], head_in: list[torch.Tensor], pass_: BackwardPass,
                  loss_scale: float) -> list[torch.Tensor]:
        """The head (each micro-batch's loss and backward), then the blocks and the embedding in
        reverse, each over every micro-batch with one fetch; each unit's grad summed on the device."""
        k = len(batches)
        grads_out: list[torch.Tensor | None] = [None] * k
        losses: list[torch.Tensor] = []
        self.store.prefetch()
        for unit in reversed(self.units):
            if unit.index in self.forward_only:
                continue
            pass_.unit_starting(unit.index)
            bound = self.runner.bound_units(unit)
            leaves = [bind(u, self.runner.gather(u.index), requires_grad=True) for u in bound]
            total: tuple[torch.Tensor, frozenset[int]] | None = None
            try:
                for m in range(k):
                    if unit.kind == "head":
                        x, head_in[m] = head_in[m], None
                    else:
                        x = batches[m][0] if unit.kind == "embedding" else self.store.get(unit.index, m)
                    inp = x.detach().requires_grad_(x.is_floating_point())
                    rng, autocast = self._rng.pop((unit.index, m), (rng_state((x,)), autocast_state((x,))))
                    with torch.enable_grad(), restore_rng(rng), autocast_as(autocast):
                        out = self._call(unit, inp, batches[m][1])
                    if unit.kind == "head":
                        losses.append(out.detach())
                        scaled = out / k if k > 1 else out  # as `Engine.backward` scales it
                        (scaled * loss_scale if loss_scale != 1.0 else scaled).backward()
                    elif out.requires_grad:
                        torch.autograd.backward(out, grads_out[m])
                    grads_out[m] = inp.grad if inp.requires_grad else None
                    total = self._add(unit, bound, leaves, m, total)
                    self.store.prefetch()
            finally:
                for u in bound:
                    unbind(u, self.dtype)
                self.runner.release(unit.index)
            if total is not None:
                self.grads.offload(unit.index, *total)
        return losses

    def _add(self, unit: Unit, bound: list[Unit], leaves: list[list[torch.Tensor]], m: int,
             total: tuple[torch.Tensor, frozenset[int]] | None) -> tuple[torch.Tensor, frozenset[int]] | None:
        """Add micro-batch `m`'s grad of the call's unit to the step's sum (`prev + new` in fp32,
        as the grad home adds them); a tied embedding's grad from the head waits in the store."""
        grad = None
        for u, unit_leaves in zip(bound, leaves):
            if u.trainable_numel:
                flat, present = flat_grad(u, unit_leaves)
                if u is not unit:  # the head's use of a tied embedding: added at the embedding's
                    self.store.put(u.index, m, flat)
                else:
                    grad = flat, present
            for leaf in unit_leaves:
                leaf.grad = None
        if grad is None:
            return total
        flat, present = grad
        if unit.kind == "embedding" and any(unit.index in u.uses_with for u in self.units):
            flat.add_(self.store.get(unit.index, m))  # this use + the head's, as autograd sums them
        if total is None:
            return flat, present
        return flat.add_(total[0]), present | total[1]

    def _call(self, unit: Unit, x: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        """The unit's own forward (bound already), as the model's forward calls it."""
        args = (x, targets) if unit.kind == "head" else (x,)
        return self.runner.compute(unit, args, {}, leaves=[])


class VerticalSteps:
    """The engine's side of the schedule: decide it at the first training step, queue each
    step's micro-batches, and run the step at its last one. `engine` is the `Engine` it serves
    (its tiers, units, grads, scheduler and counters)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.on: bool | None = None  # None: not decided yet
        self.schedule: VerticalSchedule | None = None
        self.store: BoundaryStore | None = None
        self._queued: list[tuple[Any, torch.Tensor]] = []

    def horizontal(self) -> None:
        """The caller drives forward/backward itself: refuse `--schedule vertical`, else decide horizontal."""
        if self.engine.config.schedule is Schedule.VERTICAL or self.on:
            raise ConfigError("--schedule vertical runs whole steps: call train_micro_batch (or "
                              "train_step) instead of forward/backward, or use --schedule horizontal")
        if self.on is None:
            self.on = False

    def refuse_unknown_loss(self, batch: Any) -> None:
        """`train_step` reads its micro-batch's loss at once: only the step's last has one."""
        if self.wants(batch) and len(self._queued) + 1 < self.engine.config.accumulate:
            raise TierzeroError("with the vertical schedule a micro-batch's loss is known once its step's last "
                                "micro-batch has run: call train_micro_batch and read the losses after the "
                                "step, or use --schedule horizontal")

    def refuse_queued(self) -> None:
        """A checkpoint needs a finished step: queued micro-batches would be lost on resume."""
        if self._queued:
            raise TierzeroError(f"a checkpoint needs a finished optimizer step, but {len(self._queued)} of "
                                f"{self.engine.config.accumulate} micro-batches are queued for the vertical "
                                "schedule; save after the step's last train_micro_batch")

    def abort(self) -> None:
        """Drop the activations of a step that failed (its queued micro-batches go too)."""
        self._queued.clear()
        if self.store is not None:
            self.store.clear()

    def wants(self, batch: Any) -> bool:
        """Whether `batch` goes through the vertical schedule (deciding it at the first)."""
        self.engine._usable()  # open, and not broken
        if self.on is None:
            e = self.engine
            spill = any(e.placement.home(k) is Tier.NVME for k in StateKind)  # a store to spill to
            self.on = choose(e.config, e.model, e.units, batch, spill, self._fits, e.dtype.itemsize)
            if self.on:
                self._open(batch)
        return self.on

    def micro_batch(self, batch: Any) -> torch.Tensor:
        """Queue `batch`; at the step's last micro-batch run the step. A tensor that holds this
        micro-batch's loss once its step has run."""
        e = self.engine
        loss = torch.empty((), dtype=torch.float32, device=e.device)
        self._queued.append((batch, loss))
        if len(self._queued) == e.config.accumulate:
            queued, self._queued = self._queued, []
            for (_, out), value in zip(queued, self._run([b for b, _ in queued])):
                out.copy_(value)
            e.step()
        return loss

    def _fits(self, nbytes: int) -> bool:
        return nbytes <= self._room()

    def _room(self) -> int:
        e = self.engine
        return e.tiers.host_budget - e.memory.tiers[Tier.HOST].pool_bytes

    def _open(self, batch: Any) -> None:
        """Reserve the waiting activations' host budget and build the schedule."""
        e = self.engine
        e.reserve_activations(batch)
        need = waiting_bytes(e.model, tuple(batch), e.config.accumulate, e.dtype.itemsize)
        budget = min(need, e.config.activation_budget if e.config.activation_budget is not None else self._room())
        if budget < need and Tier.NVME not in e.tiers.stores:
            raise ConfigError(f"the vertical schedule's waiting activations need {need / 1e6:.1f} MB of host "
                              f"memory, {budget / 1e6:.1f} MB is left and no state lives on NVMe to spill "
                              "them to; raise --host-budget, lower --accumulate or use --schedule horizontal")
        if budget > self._room():
            raise ConfigError(f"--activation-budget {budget / 1e6:.1f} MB is more than the host budget leaves "
                              f"({self._room() / 1e6:.1f} MB); lower it or raise --host-budget")
        e.tiers.reserve(Tier.HOST, budget)
        self.store = BoundaryStore(e.tiers, budget)
        self.schedule = VerticalSchedule(e.model, e.units, e.runner, e.grads, self.store, e.dtype,
                                         forward_only(e.units))

    def _run(self, batches: list[Any]) -> list[torch.Tensor]:
        e = self.engine
        assert self.schedule is not None
        k = len(batches)
        on_device = [tuple(e.batches.to_device(b)) for b in batches]
        pass_ = e.backward_pass(0, True, combined=True)
        e.scheduler.begin(e.vertical_plan)
        try:
            with e.grads.running(pass_), e.runner.running(pass_):
                losses = self.schedule.run(on_device, pass_, e.scaler.scale)
                e.grads.flush()  # the last unit's reduction
            e.scheduler.finish()
        except BaseException as err:
            e.abort(f"a vertical step failed: {err!r}")
            raise
        e.state.micro += k
        return losses

