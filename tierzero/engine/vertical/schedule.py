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
use (no separate forward), from the same ops. Dropout draws the same masks as horizontally:
each (micro-batch, unit) call draws from a state seeded by (step, micro-batch, unit), in its
forward and its recompute, whichever schedule runs it (`tierzero.models.draws`).

What waits. Each micro-batch's input to each block waits from the block's forward to its
backward in a `BoundaryStore` (host memory under a budget, spilled to NVMe), but a block that
keeps its graphs (`--recompute auto`, `tierzero.engine.runtime.kept`): its forward sweep keeps
one graph per micro-batch, its input inside it, on the device, and its backward sweep backprops
them instead of recomputing; the last block's outputs stay on the device for the head, and the
gradients flowing back between units are k activation-sized tensors on the device. A tied
embedding's grads from the head wait in the store too, until the embedding's own backward adds
them micro-batch by micro-batch. A micro-batch's context (what a Hugging Face decoder's layers
take beside the hidden state: position embeddings, masks) is computed once, with the embedding,
and stays on the device.

Which models. A chain (`tierzero.engine.vertical.chain`) on batches `(ids, targets)`: the built-in
LLaMA family, and Hugging Face decoders in the split layout (LoRA adapters and frozen bases too);
anything else is refused (or, with `auto`, run horizontally)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tierzero.config import Execution, Recompute, Schedule, StateKind, Tier
from tierzero.engine.runtime.binding import bind, flat_grad, unbind
from tierzero.engine.runtime.kept import KeptGraph, SavedTensors, batch_tokens
from tierzero.engine.runtime.layout import RankLayout
from tierzero.engine.runtime.opened import OpenParts
from tierzero.engine.runtime.tiers import Tiers
from tierzero.engine.step.backward import BackwardPass
from tierzero.engine.step.counters import StepCounters
from tierzero.engine.step.stepper import Stepper
from tierzero.engine.vertical.boundary import BoundaryStore, aligned_nbytes
from tierzero.engine.vertical.chain import Chain, chain_of
from tierzero.errors import ConfigError, TierzeroError
from tierzero.layout.partition import Unit, forward_only
from tierzero.models.draws import seeded
from tierzero.models.loss import loss_divisor

Batch = tuple[torch.Tensor, torch.Tensor]  # token ids, targets


def waiting_bytes(
    chain: Chain, units: list[Unit], batch: Batch, accumulate: int, itemsize: int
) -> int:
    """Host bytes the vertical schedule's waiting activations take at most, as the store holds
    them (the ledger's `waiting_activations_bytes`, each entry aligned): every block
    input of every micro-batch, and a tied embedding unit's whole fp32 grad from the head
    (position tables included)."""
    embedding = units[0]
    tied = embedding.trainable_numel if embedding.world_size == 1 else embedding.padded_numel
    per_micro = (len(units) - 2) * aligned_nbytes(batch[0].numel() * chain.dim * itemsize)
    return accumulate * (per_micro + (aligned_nbytes(tied * 4) if units[-1].uses_with else 0))


def choose(
    execution: Execution,
    model: nn.Module,
    units: list[Unit],
    batch: Any,
    spill: bool,
    fits: Callable[[int], bool],
    itemsize: int,
) -> bool:
    """Whether this engine runs its steps vertically (decided at the first training step)."""
    if execution.schedule is Schedule.HORIZONTAL or (
        execution.schedule is Schedule.AUTO and execution.accumulate == 1
    ):
        return False
    chain = chain_of(model, units)
    why = chain if isinstance(chain, str) else None
    if why is None and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        why = "its batches are not (token ids, targets) pairs"
    if execution.schedule is Schedule.VERTICAL:
        if why is not None:
            raise ConfigError(
                f"--schedule vertical needs a chain of units, but {why}; use --schedule horizontal"
            )
        return True
    if why is not None or execution.recompute is Recompute.NONE:  # none keeps graphs: horizontal
        return False
    assert isinstance(chain, Chain)
    return spill or fits(waiting_bytes(chain, units, tuple(batch), execution.accumulate, itemsize))


class VerticalPass:
    """Runs one step's micro-batches unit by unit (see the module docstring)."""

    def __init__(
        self,
        layout: RankLayout,
        device: torch.device,
        opened: OpenParts,
        chain: Chain,
        store: BoundaryStore,
    ) -> None:
        self.layout, self.device, self.chain, self.store = layout, device, chain, store
        self.runner, self.grads = opened.runner, opened.grads
        self.forward_only = forward_only(layout.units)
        self.graphs: dict[tuple[int, int], KeptGraph] = {}  # (unit, micro-batch) -> kept graph

    def run(
        self,
        batches: list[Batch],
        pass_: BackwardPass,
        loss_scale: float,
        divisors: list[float | None],
    ) -> list[torch.Tensor]:
        """Forward and backward every micro-batch of one step; their losses (detached), each
        divided by its divisor (`engine.reference.loss_divisor`)."""
        for ids, _ in batches:
            self.chain.check(ids)
        try:
            last, contexts = self._forward([ids for ids, _ in batches])
            return self._backward(batches, last, contexts, pass_, loss_scale, divisors)
        except BaseException:
            self.store.clear()
            self.graphs.clear()
            raise

    def _forward(self, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
        """The embedding and the blocks, each over every micro-batch with one fetch; the last
        block's outputs (the head's inputs) and each micro-batch's context."""
        xs, contexts = list(xs), [None] * len(xs)
        for unit in self.layout.units[:-1]:
            flat = self.runner.gather(unit.index)
            bind(unit, flat)
            try:
                for m, x in enumerate(xs):
                    keep = unit.kind == "block" and self.runner.keeping.keeps(unit)
                    if unit.kind == "block" and not keep:
                        self.store.put(unit.index, m, x)
                    with seeded(self.runner.draws(unit.index, x, m)):
                        if keep:
                            xs[m] = self._keep(unit, flat, x, contexts[m], m)
                            continue
                        with torch.no_grad():
                            if unit.kind == "embedding":
                                xs[m], contexts[m] = self.chain.embed(self.runner, unit, x)
                            else:
                                xs[m] = self.chain.block(self.runner, unit, x, contexts[m])
            finally:
                unbind(unit, self.layout.dtype, self.device)
                self.runner.release(unit.index)
        return xs, contexts

    def _keep(
        self, unit: Unit, flat: torch.Tensor, x: torch.Tensor, context: Any, m: int
    ) -> torch.Tensor:
        """Block `unit`'s forward on micro-batch `m`, its graph kept to the backward sweep
        (`runtime.kept`): its input waits inside it, on the device; its output."""
        inp = x.detach().requires_grad_(x.is_floating_point())
        graph = KeptGraph.record(
            unit,
            flat,
            [inp],
            lambda _: self.chain.block(self.runner, unit, inp, context),
            self.layout.dtype,
            self.device,
        )
        self.graphs[unit.index, m] = graph
        return graph.out.detach()

    def _backward(
        self,
        batches: list[Batch],
        head_in: list[torch.Tensor],
        contexts: list[Any],
        pass_: BackwardPass,
        loss_scale: float,
        divisors: list[float | None],
    ) -> list[torch.Tensor]:
        """The head (each micro-batch's loss and backward), then the blocks and the embedding in
        reverse, each over every micro-batch with one fetch; each unit's grad summed on the
        device."""
        k = len(batches)
        grads_out: list[torch.Tensor | None] = [None] * k
        losses: list[torch.Tensor] = []
        self.store.prefetch()
        for unit in reversed(self.layout.units):
            if unit.index in self.forward_only:
                continue
            pass_.unit_starting(unit.index)
            bound = self.runner.bound_units(unit)
            flats = [self.runner.gather(u.index) for u in bound]
            leaves = [bind(u, flat, requires_grad=True) for u, flat in zip(bound, flats)]
            total: tuple[torch.Tensor, frozenset[int]] | None = None
            try:
                for m in range(k):
                    graph = self.graphs.pop((unit.index, m), None)
                    if graph is not None:
                        grad, (grads_out[m],) = graph.backprop(unit, flats[0], (grads_out[m],), [0])
                        total = self._sum(unit, m, grad, total)
                        self.store.prefetch()
                        continue
                    if unit.kind == "head":
                        x, head_in[m] = head_in[m], None
                    else:
                        x = (
                            batches[m][0]
                            if unit.kind == "embedding"
                            else self.store.get(unit.index, m)
                        )
                    inp = x.detach().requires_grad_(x.is_floating_point())
                    measuring = unit.kind == "block" and self.runner.keeping.measuring
                    saved = SavedTensors(flats[0], [inp]) if measuring else None
                    with (
                        torch.enable_grad(),
                        seeded(self.runner.draws(unit.index, x, m)),
                        saved.hooks() if saved else contextlib.nullcontext(),
                    ):
                        out = self._call(unit, inp, batches[m][1], contexts[m], divisors[m])
                    if saved is not None:  # a kept graph would hold its input too
                        self.runner.keeping.measure(unit, saved, held=inp.nbytes)
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
                    unbind(u, self.layout.dtype, self.device)
                self.runner.release(unit.index)
            if total is not None:
                self.grads.offload(unit.index, *total)
        return losses

    def _add(
        self,
        unit: Unit,
        bound: list[Unit],
        leaves: list[list[torch.Tensor]],
        m: int,
        total: tuple[torch.Tensor, frozenset[int]] | None,
    ) -> tuple[torch.Tensor, frozenset[int]] | None:
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
        return self._sum(unit, m, grad, total)

    def _sum(
        self,
        unit: Unit,
        m: int,
        grad: tuple[torch.Tensor, frozenset[int]] | None,
        total: tuple[torch.Tensor, frozenset[int]] | None,
    ) -> tuple[torch.Tensor, frozenset[int]] | None:
        """Micro-batch `m`'s `grad` of `unit` added to the step's `total` (a tied embedding's
        use by the head first added to its own, as autograd sums them)."""
        if grad is None:
            return total
        flat, present = grad
        if unit.kind == "embedding" and any(unit.index in u.uses_with for u in self.layout.units):
            flat.add_(self.store.get(unit.index, m))  # this use + the head's, as autograd sums them
        if total is None:
            return flat, present
        return flat.add_(total[0]), present | total[1]

    def _call(
        self,
        unit: Unit,
        x: torch.Tensor,
        targets: torch.Tensor,
        context: Any,
        divisor: float | None,
    ) -> torch.Tensor:
        """The unit's own forward (bound already), as the model's forward calls it, with grad."""
        if unit.kind == "head":
            return self.chain.head(self.runner, unit, x, targets, divisor)
        if unit.kind == "embedding":
            return self.chain.first_hidden(self.runner, unit, x)
        return self.chain.block(self.runner, unit, x, context)


class VerticalSteps:
    """The engine's side of the schedule: decide it at the first training step, queue each
    step's micro-batches, and run the step at its last one through the `Stepper`."""

    def __init__(
        self,
        execution: Execution,
        model: nn.Module,
        device: torch.device,
        layout: RankLayout,
        tiers: Tiers,
        counters: StepCounters,
        opened: OpenParts,
        stepper: Stepper,
        reserve: Callable[[Any], None],
        host_room: Callable[[], int],
        keep: Callable[[Any], None],
        measured: Callable[[], None],
    ) -> None:
        """`reserve`: takes the first step's activations out of the budgets (`Sizing`);
        `host_room`: the host memory the budgets leave (the waiting activations' room); `keep`:
        chooses the blocks that keep their graphs once those have their room; `measured`:
        chooses them from what the first step measured (a model built elsewhere)."""
        self.execution, self.model, self.device, self.layout = execution, model, device, layout
        self.tiers, self.counters, self.opened, self.stepper = tiers, counters, opened, stepper
        self.reserve, self.host_room, self.keep, self.measured = reserve, host_room, keep, measured
        self.on: bool | None = None  # None: not decided yet
        self.vertical_pass: VerticalPass | None = None
        self.store: BoundaryStore | None = None
        self._queued: list[
            tuple[Any, torch.Tensor, float | None]
        ] = []  # batch, its loss, its divisor

    def horizontal(self) -> None:
        """The caller drives forward/backward itself: refuse `--schedule vertical`, else decide
        horizontal."""
        if self.execution.schedule is Schedule.VERTICAL or self.on:
            raise ConfigError(
                "--schedule vertical runs whole steps: call train_micro_batch (or "
                "train_step) instead of forward/backward, or use --schedule horizontal"
            )
        if self.on is None:
            self.on = False

    def refuse_unknown_loss(self, batch: Any) -> None:
        """`train_step` reads its micro-batch's loss at once: only the step's last has one (so
        `auto`, undecided, decides horizontal)."""
        if self.on is None and self.execution.schedule is Schedule.AUTO:
            self.on = False
        if self.wants(batch) and len(self._queued) + 1 < self.execution.accumulate:
            raise TierzeroError(
                "with the vertical schedule a micro-batch's loss is known once its step's last "
                "micro-batch has run: call train_micro_batch and read the losses after the "
                "step, or use --schedule horizontal"
            )

    def refuse_queued(self) -> None:
        """A checkpoint needs a finished step: queued micro-batches would be lost on resume."""
        if self._queued:
            raise TierzeroError(
                f"a checkpoint needs a finished optimizer step, but {len(self._queued)} of "
                f"{self.execution.accumulate} micro-batches are queued for the vertical "
                "schedule; save after the step's last train_micro_batch"
            )

    def abort(self) -> None:
        """Drop the activations of a step that failed (its queued micro-batches go too)."""
        self._queued.clear()
        if self.store is not None:
            self.store.clear()

    def wants(self, batch: Any) -> bool:
        """Whether `batch` goes through the vertical schedule (deciding it at the first)."""
        if self.on is None:
            # a store to spill to
            spill = any(self.layout.placement.home(k) is Tier.NVME for k in StateKind)
            units, itemsize = self.layout.units, self.layout.dtype.itemsize
            self.on = choose(self.execution, self.model, units, batch, spill, self._fits, itemsize)
            if self.on:
                self._open(batch)
        return self.on

    def micro_batch(self, batch: Any, step_tokens: int | None = None) -> torch.Tensor:
        """Queue `batch`; at the step's last micro-batch run the step. A tensor that holds this
        micro-batch's loss once its step has run (`step_tokens`: as `Engine.forward`)."""
        accumulate = self.execution.accumulate
        loss = torch.empty((), dtype=torch.float32, device=self.device)
        divisor = loss_divisor(step_tokens, False, accumulate, self.layout.comm.world_size)
        self._queued.append((batch, loss, divisor))
        if len(self._queued) == accumulate:
            queued, self._queued = self._queued, []
            for (_, out, _), value in zip(
                queued, self._run([b for b, _, _ in queued], [d for _, _, d in queued])
            ):
                out.copy_(value)
            self.stepper.step()
        return loss

    def _fits(self, nbytes: int) -> bool:
        return nbytes <= self.host_room()

    def _open(self, batch: Any) -> None:
        """Reserve the waiting activations' host budget and build the schedule."""
        self.reserve(batch)
        room = self.host_room()
        chain = chain_of(self.model, self.layout.units)
        assert isinstance(chain, Chain)  # `choose` checked it
        units, itemsize = self.layout.units, self.layout.dtype.itemsize
        need = waiting_bytes(chain, units, tuple(batch), self.execution.accumulate, itemsize)
        given = self.execution.activation_budget
        budget = min(need, given if given is not None else room)
        if budget < need and Tier.NVME not in self.tiers.stores:
            raise ConfigError(
                f"the vertical schedule's waiting activations need {need / 1e6:.1f} MB of host "
                f"memory, {budget / 1e6:.1f} MB is left and no state lives on NVMe to spill "
                "them to; raise --host-budget, lower --accumulate or use --schedule horizontal"
            )
        if budget > room:
            raise ConfigError(
                f"--activation-budget {budget / 1e6:.1f} MB is more than the host budget leaves "
                f"({room / 1e6:.1f} MB); lower it or raise --host-budget"
            )
        self.tiers.reserve(Tier.HOST, budget)
        self.store = BoundaryStore(self.tiers, budget)
        self.vertical_pass = VerticalPass(self.layout, self.device, self.opened, chain, self.store)
        self.keep(batch)

    def _run(self, batches: list[Any], divisors: list[float | None]) -> list[torch.Tensor]:
        state, o = self.counters.state, self.opened
        assert self.vertical_pass is not None
        k = len(batches)
        on_device = [tuple(o.batches.to_device(b)) for b in batches]
        o.runner.position = state.step_count, 0  # the step's draws (`tierzero.models.draws`)
        o.runner.keeping.start(max(batch_tokens(b) for b in batches))
        pass_ = self.stepper.backward_pass(0, True, combined=True)
        o.swap_runner.begin(o.vertical_plan)
        try:
            with o.grads.running(pass_), o.runner.running(pass_):
                losses = self.vertical_pass.run(
                    on_device, pass_, self.counters.scaler.scale, divisors
                )
                o.grads.flush()  # the last unit's reduction
            o.swap_runner.finish()
        except BaseException as err:
            self.abort()
            self.stepper.abort(f"a vertical step failed: {err!r}")
            raise
        state.micro += k
        self.measured()
        return losses
