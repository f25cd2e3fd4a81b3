"""`Engine`: the object a training loop talks to.

    engine = tierzero.Engine(model, config)      # validates; allocates nothing
    loss = engine.forward(batch)                 # opens the tiers on first use
    engine.backward(loss)
    engine.step()                                # steps once per `accumulate` micro-batches

or `engine.train_step(batch)`. The model may be on `meta` (it is materialised unit by unit
into the tiers) or already built (its weights are adopted and its own storage freed). From
then on the engine owns every parameter: the modules' weights are views bound while a unit
computes and meta placeholders otherwise. A frozen parameter (`requires_grad=False`, e.g. the
base under LoRA adapters) is stored once, as a param in the compute dtype, fetched for compute
like the rest and never written; a parameter that gets no gradient in a step is not updated,
as torch's AdamW skips it (`tierzero.engine.step.skipped`).

The public face is what a user's own loop needs: `forward`/`backward`/`step` (or
`train_step`, `train_micro_batch`), `eval_loss`/`evaluate`, `gathered` (the full weights for a
custom loss or evaluation), `save_checkpoint`/`load_checkpoint`, `master_state_dict` and
`read_shard`/`keys` (export, inspection), `stats`/`notes`, `open`/`close`, and the `config`,
`device`, `units`, `step_count` and `last_grad_norm` it runs with. What it built is inspected
through `parts` (`parts.EngineParts`, made without I/O) and `opened`
(`runtime.opened.OpenParts`, made by `open`); the step policy is the `step.stepper.Stepper`'s,
the schedules `schedule.HorizontalSteps` and `vertical.schedule.VerticalSteps`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierzero.checkpoint.manifest import Manifest
from tierzero.config import Config, Recompute, StateKind, Tier
from tierzero.engine import checkpointing
from tierzero.engine.gathered import GatheredBlocks, copies, resolve
from tierzero.engine.parts import EngineParts
from tierzero.engine.runtime.binding import bind, flat_grad, unbind
from tierzero.engine.runtime.kept import batch_tokens
from tierzero.engine.runtime.opened import OpenParts, open_parts
from tierzero.engine.schedule import HorizontalSteps, StepSchedule
from tierzero.engine.step.stepper import Stepper
from tierzero.engine.vertical.evaluate import evaluate_windows, evaluating
from tierzero.engine.vertical.schedule import VerticalSteps
from tierzero.errors import TierzeroError
from tierzero.layout.partition import Unit
from tierzero.models.init import weight_files
from tierzero.models.loss import compute_loss, loss_divisor


class Engine:
    def __init__(self, model: nn.Module, config: Config, weights: str | Path | None = None) -> None:
        self.parts = EngineParts.build(model, config)
        if weights is not None:
            weight_files(weights)  # refuse a wrong path now, before anything is written
        self._weights = weights
        self._open = False
        self._closed = False
        self._reserved = False  # the first training step's activations taken from the budgets
        self._root_leaves: list[torch.Tensor] | None = None
        self._blocks = GatheredBlocks(self.parts.layout.units)
        # built by `open`: the runtime, the step policy and the vertical schedule (decided at the
        # first step)
        self.opened: OpenParts | None = None
        self._stepper: Stepper | None = None
        self.vertical: VerticalSteps | None = None
        self.horizontal: HorizontalSteps | None = None

    # what a loop reads; the rest (tiers, sizing, counters, the runtime) is inspection, on
    # `parts` (built without I/O) and `opened` (built by `open`)
    config = property(
        attrgetter("parts.config"), doc="The config as resolved (piece size, prefetch depth)."
    )
    device = property(attrgetter("parts.device"), doc="The compute device.")
    units = property(attrgetter("parts.layout.units"), doc="The units, in order.")
    step_count = property(
        attrgetter("parts.counters.state.step_count"), doc="Optimizer steps taken."
    )
    last_grad_norm = property(
        attrgetter("parts.counters.state.last_grad_norm"), doc="The latest global grad norm."
    )

    # -- lifecycle ----------------------------------------------------------------------------

    def open(self) -> Engine:
        """Open the tiers and move every unit's state into its home, one unit at a time."""
        p = self.parts
        return self._open_with(
            lambda: p.shards.materialise(p.model, p.layout.units, p.config.seed, self._weights)
        )

    def _open_with(self, fill: Callable[[], None]) -> Engine:
        """Open the tiers, fill them (`Shards.materialise`, or a checkpoint's restore), build the
        step."""
        if self._open:
            return self
        if self._closed:
            raise TierzeroError(
                "this engine is closed; read master_state_dict() before close(), "
                "or build a new Engine"
            )
        p = self.parts
        self.opened = opened = open_parts(p, fill)
        config, layout, tiers, counters = p.config, p.layout, p.tiers, p.counters
        self._stepper = stepper = Stepper(
            layout,
            tiers,
            counters,
            config.optimizer,
            config.execution.accumulate,
            p.overlap,
            p.param_order,
            opened,
        )
        self.vertical = VerticalSteps(
            config.execution,
            p.model,
            p.device,
            layout,
            tiers,
            counters,
            opened,
            stepper,
            lambda batch: self._reserve_activations(batch, vertical=True),
            self._host_room,
            lambda batch: p.sizing.keep_vertical(tiers, opened.runner.keeping, layout, batch),
            lambda: p.sizing.keep_measured(
                tiers, opened.runner.keeping, config.execution.accumulate
            ),
        )
        self.horizontal = HorizontalSteps(self.forward, self.backward, self.step)
        self._open = True
        return self

    def close(self) -> None:
        """Finish every transfer, make nvme state durable, release the tiers. Idempotent."""
        if self._open:
            self.opened.runner.uninstall()
            self._open = False
        self._closed = True
        self.parts.tiers.close()

    def __enter__(self) -> Engine:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one step -------------------------------------------------------------------------------

    def forward(
        self, batch: Any, step_tokens: int | None = None, summed: bool = False
    ) -> torch.Tensor:
        """One micro-batch's loss (with grad: for `backward`), divided as `loss_divisor` says for
        `step_tokens`."""
        p = self.parts
        divisor = loss_divisor(
            step_tokens, summed, p.config.execution.accumulate, p.layout.comm.world_size
        )
        self._settle()
        o = self.opened
        training = torch.is_grad_enabled()
        if training:
            self.vertical.horizontal()
            self._reserve_activations(batch, vertical=bool(self.vertical.on))
            o.runner.keeping.start(batch_tokens(batch))
            o.runner.position = (
                p.counters.state.step_count,
                p.counters.state.micro % p.config.execution.accumulate,
            )  # its draws
        o.swap_runner.begin(o.train_plan if training else o.eval_plan)
        root = p.layout.units[0]
        try:
            if root.is_root:  # a model without embedding/head entry points: bound for the pass
                self._root_leaves = bind(root, o.swap_runner.acquire(0), requires_grad=training)
            loss = compute_loss(p.model, o.batches.to_device(batch), divisor)
        except BaseException:
            self._abort()
            raise
        if not training:
            if root.is_root:
                unbind(root, p.layout.dtype, p.device)
                self._root_leaves = None
            o.swap_runner.finish()
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backprop one micro-batch; every unit's grad is accumulated into its home tier."""
        self._usable()
        p, o = self.parts, self.opened
        accumulate, state = p.config.execution.accumulate, p.counters.state
        last = state.ends_step(accumulate)
        scale = p.counters.scaler.scale
        self._blocks.refuse_closed(loss)
        scaled = loss / accumulate if accumulate > 1 else loss
        scaled = scaled * scale if scale != 1.0 else scaled
        try:
            pass_ = self._stepper.backward_pass(
                state.micro % accumulate, last, self._blocks.grads(scaled)
            )
            with o.grads.running(pass_), o.runner.running(pass_):
                scaled.backward()
                if self._root_leaves is not None:
                    if p.layout.units[0].trainable_numel:
                        o.grads.offload(0, *flat_grad(p.layout.units[0], self._root_leaves))
                    unbind(p.layout.units[0], p.layout.dtype, p.device)
                    self._root_leaves = None
                o.grads.flush()  # the last unit's reduction
            o.swap_runner.finish()
        except BaseException as e:
            self._abort(f"backward failed: {e!r}")  # some units' grads are accumulated, some not
            raise
        state.micro += 1
        if last:
            p.sizing.keep_measured(p.tiers, o.runner.keeping)

    def step(self) -> bool:
        """Update every shard if a global batch is complete; False if none ran (or fp16 skipped)."""
        self._usable()
        return self._stepper.step()

    @contextlib.contextmanager
    def gathered(
        self, names: Iterable[str] | str | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The full current weights of `names` (every parameter by default) for user code: a
        custom loss, a regulariser on the weights, evaluation. Copies on the compute device in
        the compute dtype; trainable ones require grad, and `engine.backward(loss)` called inside
        the block adds the gradients that reach them to the step's (see `tierzero.engine.gathered`).
        Released on exit; changing a copy changes nothing in the engine."""
        self._settle()
        p = self.parts
        p.tiers.pending.drain()  # params written by the last step must have landed
        with self._blocks.block(
            copies(
                p.layout.units,
                resolve(p.layout.units, names),
                lambda unit: p.shards.full_params(unit, p.layout.comm, p.device),
            )
        ) as view:
            yield view

    def train_step(self, batch: Any, step_tokens: int | None = None) -> float:
        """forward + backward + step (the step runs once per `accumulate` calls); the loss."""
        self._usable()
        self.vertical.refuse_unknown_loss(batch)
        return self.train_micro_batch(
            batch, step_tokens
        ).item()  # host sync point: waits for the whole pass

    def train_micro_batch(self, batch: Any, step_tokens: int | None = None) -> torch.Tensor:
        """`train_step` without reading the loss (a detached tensor): a loop that reads the
        micro-batches' losses once per step syncs with the device once per step, not per call."""
        self.parts.model.train()
        self._usable()
        return self._schedule(batch).micro_batch(batch, step_tokens)

    @torch.no_grad()
    def eval_loss(self, batch: Any, summed: bool = False) -> float:
        """The loss in eval mode (dropout off), without grad; the model's mode is restored.
        `summed`: as `forward`."""
        with evaluating(self.parts.model):
            return self.forward(batch, summed=summed).item()

    def evaluate(self, windows: list[Any]) -> list[float]:
        """Each window's summed trained-token loss (`eval_loss(w, summed=True)`), every unit's
        params read once for all of them, not once per window
        (`tierzero.engine.vertical.evaluate`)."""
        self._settle()
        return evaluate_windows(
            self.parts, self.opened, windows, lambda w: self.eval_loss(w, summed=True)
        )

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(
        self,
        run_dir: str | Path,
        data: dict[str, Any] | None = None,
        keep: int | None = None,
        model: dict[str, Any] | None = None,
    ) -> Path:
        """Save every shard at this step into `run_dir/checkpoints/step-<N>` (hard links for
        NVMe-homed state: metadata, not bytes); `data` is the caller's data position, `keep`
        prunes to the newest K. See `tierzero.engine.checkpointing`."""
        self._settle()
        self._current().refuse_queued()
        return checkpointing.save(self.parts, run_dir, data=data, keep=keep, model=model)

    def load_checkpoint(self, path: str | Path) -> Manifest:
        """Continue from a checkpoint: `path` is a `step-<N>` directory, or a run directory (its
        newest intact checkpoint; damaged newer ones are skipped and named in `notes()`). Every
        array is verified first. Returns the manifest (its `data` is the caller's to restore)."""
        if self._stepper is not None and self._stepper.broken is not None:
            self._usable()
        path, manifest = checkpointing.find(Path(path), self.parts.layout.comm, self.parts.note)
        if self._open:
            self._current().abort()  # micro-batches queued before the load belong to no step of it
            self.parts.tiers.pending.drain()
            checkpointing.restore(self.parts, path, manifest)
        else:
            self._open_with(lambda: checkpointing.restore(self.parts, path, manifest))
        return manifest

    def notes(self) -> list[str]:
        """What the engine and its stores could not do as asked, or chose instead, once each."""
        return self.parts.notes()

    # -- state ----------------------------------------------------------------------------------

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under every parameter name (tied aliases included), unit by unit;
        a frozen parameter's stored values, in fp32. The whole model in host memory: for small
        models and tests (large ones: checkpoint and stream out with `tierzero export`)."""
        self._settle()
        return self.parts.shards.master_state_dict(self.parts.layout.units, self.parts.layout.comm)

    def keys(self, kind: StateKind, unit: Unit) -> list[tuple[str, int, int]]:
        """This rank's store keys of `kind` for `unit`, with the shard range each holds."""
        return self.parts.shards.keys(kind, unit)

    def read_shard(self, kind: StateKind, unit: Unit) -> torch.Tensor:
        """A CPU copy of this rank's shard of `kind` for `unit` (inspection, export:
        `Shards.read_shard`)."""
        self._settle(kind)
        return self.parts.shards.read_shard(kind, unit)

    def stats(self) -> dict[str, Any]:
        """Per-step counters for metrics.jsonl: bytes per direction, I/O wait, peak bytes."""
        return self.parts.metrics(peaks=self._open)

    # -- internals ------------------------------------------------------------------------------

    def _settle(self, kind: StateKind | None = None) -> None:
        """Before shards are read: usable (`read_*` of one kind: as it is), an overlapped step
        settled, a grad landed."""
        if kind is None:
            self._usable()
        if self.parts.counters.state.stepped_in_backward and self._stepper.broken is None:
            self.step()  # overlap_step already updated the shards: settle it before reading them
        if kind is StateKind.GRAD and self._open:
            self.opened.grads.settle()

    def _schedule(self, batch: Any) -> StepSchedule:
        """The step schedule this engine trains with, decided at its first training batch."""
        return self.vertical if self.vertical.wants(batch) else self.horizontal

    def _current(self) -> StepSchedule:
        """The schedule decided so far (undecided: nothing is queued, as horizontally)."""
        return self.vertical if self.vertical.on else self.horizontal

    def _reserve_activations(self, batch: Any, vertical: bool) -> None:
        """At the first training step: take its activations out of the budgets (`Sizing`)."""
        if self._reserved:
            return
        self._reserved = True
        p = self.parts
        placement, stage = p.layout.placement, p.layout.stage
        memory = p.sizing.reserve_activations(
            p.tiers, p.model, batch, placement, stage, vertical=vertical
        )
        keeping = self.opened.runner.keeping  # the units whose forward keeps its graph
        keeping.choose(p.sizing.kept, batch_tokens(batch))
        keeping.measuring = (
            p.sizing.activations is None and p.config.execution.recompute is Recompute.AUTO
        )
        p.tiers.provision_host(memory)

    def _host_room(self) -> int:
        """Host memory the budgets leave beyond the pools' peaks (the vertical schedule's
        waiting activations' room)."""
        p = self.parts
        return p.tiers.host_budget - p.sizing.current.tiers[Tier.HOST].pool_bytes

    def _usable(self) -> None:
        """Open on first use; refuse to go on from a step that stopped half-way."""
        if self._stepper is not None and self._stepper.broken is not None:
            raise TierzeroError(
                f"the engine stopped in the middle of a step ({self._stepper.broken}); its tiers "
                "may hold a partial update, so close it and start again"
            )
        self.open()

    def _abort(self, broken: str | None = None) -> None:
        """Drop what a pass holds; `broken`: why it stopped half-way (then `_usable` refuses)."""
        self._current().abort()
        if self._root_leaves is not None:
            unbind(self.parts.layout.units[0], self.parts.layout.dtype, self.parts.device)
            self._root_leaves = None
        self._stepper.abort(broken)
