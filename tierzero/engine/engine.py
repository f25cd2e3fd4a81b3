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
as torch's AdamW skips it (`tierzero.engine.step.paramsteps`).

The engine is where the step's parts meet; each lives in its own module and is only wired
here: the counters (`state.StepState`), stored shards (`shards`), tiers, sizing, the swap plan
and its scheduler, unit execution, one backward's facts (`backward.BackwardPass`), grads, the
optimizer, checkpoints (`checkpointing`) and `gathered` blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierzero.distributed.comm import Comm
from tierzero.config import TORCH_DTYPES, Config, StateKind, Tier
from tierzero.errors import TierzeroError
from tierzero.engine.runtime.batch import BatchStaging
from tierzero.engine.step.backward import BackwardPass, StepInBackward, clip_coefficient, resolve_overlap, settle_clip
from tierzero.engine.runtime.execute import UnitRunner, bind, flat_grad, place_buffers, unbind
from tierzero.engine.gathered import GatheredBlocks, copies, resolve
from tierzero.engine.step.grads import GradShards
from tierzero.engine.runtime.shards import Shards
from tierzero.engine import checkpointing
from tierzero.engine.step.state import StepState
from tierzero.models.init import weight_files
from tierzero.distributed.launch import local_world_size
from tierzero.lr import lr_at
from tierzero.checkpoint.manifest import Manifest
from tierzero.engine.step.optim import ShardOptimizer
from tierzero.engine.step.paramsteps import ParamSteps, Run
from tierzero.engine.step.paramsync import sync_params
from tierzero.layout.partition import Unit, forward_only, grad_uses, partition, replicate_params
from tierzero.precision import DynamicLossScaler, compute_dtype, resolve_dtype
from tierzero.reference import compute_loss, loss_divisor
from tierzero.engine.runtime.scheduler import Scheduler
from tierzero.planning.swapplan import swap_plans
from tierzero.engine.sizing import Sizing, check_runnable
from tierzero.engine.runtime.stats import StepStats
from tierzero.engine.runtime.tiers import Tiers
from tierzero.engine.vertical.schedule import VerticalSteps


class Engine:
    def __init__(self, model: nn.Module, config: Config, weights: str | Path | None = None) -> None:
        self.config = config
        self.device = config.resolved_device()
        self.dtype = compute_dtype(resolve_dtype(config.dtype, self.device), self.device)
        self.model = model
        self.comm = Comm(self.device, TORCH_DTYPES[config.grad_reduce_dtype])
        self.local_ranks = local_world_size(self.comm)  # they share this machine's RAM and drives
        self.units = partition(model, self.comm.world_size, config.units)
        self.param_steps = ParamSteps(self.units)
        self.param_order = [name for name, _ in model.named_parameters()]
        self.scaler = DynamicLossScaler(config.loss_scale, config.loss_scale_window,
                                        enabled=self.dtype == torch.float16)
        self.overlap = resolve_overlap(config, self.scaler.enabled)  # units step in backward
        self.sizing = Sizing(config, self.device, self.dtype, self.units, self.comm.world_size,
                             self.local_ranks, self.overlap)
        # `offload auto` picks a placement for the forced stage, else stage 3's
        self.placement = self.sizing.placement(config.stage or 3)
        check_runnable(self.placement)
        self.stage, self.stage_reason = self.sizing.stage(self.placement)
        # piece size and prefetch depth left unset: the defaults, or the largest that fit the budgets
        self.config = config = self.sizing.resolve(self.placement, self.stage)
        replicate_params(self.units, self.stage <= 2)
        homes = {self.placement.home(k) for k in StateKind}
        self.stats_ = StepStats()
        self.tiers = Tiers(config, self.device, homes, self.comm.rank if self.comm.world_size > 1 else None,
                           self.stats_, self.local_ranks)
        self.tiers.check_paths()  # reads metadata only: `open` makes the directories
        self.shards = Shards(self.tiers, self.placement, self.comm.rank, config.piece_numel, self.dtype)
        self.memory = self.sizing.check(self.tiers, self.placement, self.stage)
        if weights is not None:
            weight_files(weights)  # refuse a wrong path now, before anything is written
        self.weights = weights
        self.state = StepState()
        self._open = False
        self._closed = False
        self._broken: str | None = None  # why a step stopped half-way, leaving partial state
        self._root_leaves: list[torch.Tensor] | None = None
        self._notes: list[str] = []
        self._activations_reserved = False
        self._blocks = GatheredBlocks(self.units)
        self.vertical = VerticalSteps(self)  # `config.schedule`: decided at the first training step

    # the counters, read-only here: the step and checkpoints advance and restore `state`
    step_count = property(lambda self: self.state.step_count, doc="Optimizer steps taken.")
    micro = property(lambda self: self.state.micro, doc="Micro-batches backpropagated.")
    skipped_steps = property(lambda self: self.state.skipped_steps, doc="fp16 steps skipped for overflow.")
    last_grad_norm = property(lambda self: self.state.last_grad_norm, doc="The latest global grad norm.")

    # -- lifecycle ----------------------------------------------------------------------------

    def open(self) -> Engine:
        """Open the tiers and move every unit's state into its home, one unit at a time."""
        return self._open_with(lambda: self.shards.materialise(self.model, self.units, self.config.seed,
                                                               self.weights))

    def _open_with(self, fill: Callable[[], None]) -> Engine:
        """Open the tiers, fill them (`Shards.materialise`, or a checkpoint's restore), build the step."""
        if self._open:
            return self
        if self._closed:
            raise TierzeroError("this engine is closed; read master_state_dict() before close(), "
                                "or build a new Engine")
        if self.device.type == "cuda":
            # The training thread's current device is the engine's, as it is on autograd's
            # thread for it: torch code that uses the current device (an optimizer's
            # `current_stream()`, `.cuda()`) then never creates a context on cuda:0.
            torch.cuda.set_device(self.device)
        self.tiers.open()
        try:
            place_buffers(self.model, self.device)
            fill()
            self.batches = BatchStaging(self.tiers.streams)  # pinned, reused across micro-batches
            self.scheduler = Scheduler(self.units, self.tiers, self.placement.param, self.dtype,
                                       self.comm, self.config.piece_numel, self.stats_)
            self.grads = GradShards(self.units, self.tiers, self.placement.grad, self.comm, self.stats_,
                                    grad_uses(self.units), self.config.piece_numel,
                                    norms=self.config.clip_grad_norm is not None,
                                    finite=self.scaler.enabled,
                                    overlap=self.config.overlap_comm and self.comm.world_size > 1,
                                    full_until_last=self.stage == 1 and self.comm.world_size > 1)
            self.grads.allocate()
            self.optimizer = ShardOptimizer(self.units, self.tiers, self.placement, self.dtype,
                                            self.comm.rank, self.config, self.stats_, self.scheduler.written)
            self.runner = UnitRunner(self.units, self.scheduler.acquire, self.scheduler.release, self.grads.offload,
                                     self.dtype, forward_only(self.units), self.config.seed)
            self.runner.install()
            replicated = self.comm.world_size == 1 or self.stage <= 2  # nothing to gather
            self.train_plan, self.eval_plan, self.vertical_plan = swap_plans(
                self.units, self.config.prefetch_depth, None if replicated else int(self.config.overlap_comm),
                self.config.accumulate)
        except BaseException:
            self.tiers.close()
            raise
        self._open = True
        return self

    def close(self) -> None:
        """Finish every transfer, make nvme state durable, release the tiers. Idempotent."""
        if self._open:
            self.runner.uninstall()
            self._open = False
        self._closed = True
        self.tiers.close()

    def __enter__(self) -> Engine:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one step -------------------------------------------------------------------------------

    def forward(self, batch: Any, step_tokens: int | None = None, summed: bool = False) -> torch.Tensor:
        """One micro-batch's loss (with grad: for `backward`), divided as `loss_divisor` says for `step_tokens`."""
        divisor = loss_divisor(step_tokens, summed, self.config.accumulate, self.comm.world_size)
        self._settle()
        training = torch.is_grad_enabled()
        if training:
            self.vertical.horizontal()
            self.reserve_activations(batch)
            self.runner.position = self.state.step_count, self.state.micro % self.config.accumulate  # its draws
        self.scheduler.begin(self.train_plan if training else self.eval_plan)
        root = self.units[0]
        try:
            if root.is_root:  # a model without embedding/head entry points: bound for the pass
                self._root_leaves = bind(root, self.scheduler.acquire(0), requires_grad=training)
            loss = compute_loss(self.model, self.batches.to_device(batch), divisor)
        except BaseException:
            self.abort()
            raise
        if not training:
            if root.is_root:
                unbind(root, self.dtype)
                self._root_leaves = None
            self.scheduler.finish()
        return loss

    def reserve_activations(self, batch: Any) -> None:
        """At the first training step: take its activations out of the budgets (`Sizing`)."""
        if not self._activations_reserved:
            self._activations_reserved = True
            self.memory = self.sizing.reserve_activations(self.tiers, self.model, batch, self.memory, self.placement,
                                                          self.stage, vertical=bool(self.vertical.on))
            self.runner.kept = self.sizing.kept  # blocks whose forward keeps its graph (`planning.recompute`)
            self.tiers.provision_host(self.memory)

    def backward(self, loss: torch.Tensor) -> None:
        """Backprop one micro-batch; every unit's grad is accumulated into its home tier."""
        self._usable()
        accumulate, state = self.config.accumulate, self.state
        last = state.ends_step(accumulate)
        scale = self.scaler.scale
        self._blocks.refuse_closed(loss)
        scaled = loss / accumulate if accumulate > 1 else loss
        scaled = scaled * scale if scale != 1.0 else scaled
        try:
            pass_ = self.backward_pass(state.micro % accumulate, last, self._blocks.grads(scaled))
            with self.grads.running(pass_), self.runner.running(pass_):
                scaled.backward()
                if self._root_leaves is not None:
                    if self.units[0].trainable_numel:
                        self.grads.offload(0, *flat_grad(self.units[0], self._root_leaves))
                    unbind(self.units[0], self.dtype)
                    self._root_leaves = None
                self.grads.flush()  # the last unit's reduction
            self.scheduler.finish()
        except BaseException as e:
            self.abort(f"backward failed: {e!r}")  # some units' grads are accumulated, some not
            raise
        state.micro += 1

    def backward_pass(self, micro: int, last: bool, extra: dict | None = None, combined: bool = False) -> BackwardPass:
        """One backward's facts; with overlap_step the step's last also steps each unit."""
        step = StepInBackward.for_step(self.optimizer, self.units, self.config, self.state, self._runs) \
            if last and self.overlap else None
        return BackwardPass(micro, last, 1.0 / self.scaler.scale, extra or {}, step, combined)

    def step(self) -> bool:
        """Update every shard if a global batch is complete; False if none ran (or fp16 skipped)."""
        self._usable()
        if not self.state.step_due(self.config.accumulate):
            return False
        try:
            self.state.stepped_at = self.state.micro
            stepped = self._step()
            if stepped:  # superseded blocks become spares, behind the next step (no sync here)
                self.tiers.flush_behind()
            return stepped
        except BaseException as e:
            self._broken = f"the optimizer step failed: {e!r}"  # some shards are updated, some not
            raise

    def _step(self) -> bool:
        self.tiers.pending.drain()  # grads written during backward must land before they are read
        self.grads.settle()  # and those copied to host memory
        state = self.state
        if state.stepped_in_backward:  # overlap_step: every unit was stepped as its grad arrived
            state.stepped_in_backward = False
            if self.config.clip_grad_norm is not None:  # this step's norm: a fired clip re-steps it,
                # or (clip_previous_norm) it clips the next, from this host copy without a device sync
                state.previous_norm = self.grads.total_norm(self.param_order).cpu()
                state.last_grad_norm = state.previous_norm.item()
                settle_clip(self.optimizer, state.previous_norm, self.config, state.step_count)
            self.param_steps.advance(self.grads.present)
            self._sync_params()
            state.step_count += 1
            return True
        if self.scaler.enabled and not self.scaler.update(self.grads.found_inf()):
            state.skipped_steps += 1  # overflow: nothing is written, the schedule does not advance
            return False
        coef = None
        if self.config.clip_grad_norm is not None:
            norm = self.grads.total_norm(self.param_order)
            state.last_grad_norm = norm.item()
            # a host float (one sync per step): with a device tensor every CPU piece's step would copy it
            coef = clip_coefficient(norm, self.config.clip_grad_norm).item()
        self.optimizer.step({u.index: self._runs(u) for u in self.units}, lr_at(state.step_count, self.config), coef)
        self.param_steps.advance(self.grads.present)
        self._sync_params()
        state.step_count += 1
        return True

    def _sync_params(self) -> None:
        """Stage 1/2: every rank stores whole units, so each gets every rank's new values."""
        if self.comm.world_size > 1 and self.stage <= 2:
            sync_params(self.units, self.tiers, self.placement.param, self.comm, self.dtype,
                        self.config.piece_numel, self.stats_)

    def _runs(self, unit: Unit) -> list[Run]:
        """What this step updates of this rank's shard of `unit`, with each run's step count."""
        return self.param_steps.runs(unit, self.comm.rank, self.grads.present.get(unit.index, ()), self.state.step_count)

    @contextlib.contextmanager
    def gathered(self, names: Iterable[str] | str | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """The full current weights of `names` (every parameter by default) for user code: a
        custom loss, a regulariser on the weights, evaluation. Copies on the compute device in
        the compute dtype; trainable ones require grad, and `engine.backward(loss)` called inside
        the block adds the gradients that reach them to the step's (see `tierzero.engine.gathered`).
        Released on exit; changing a copy changes nothing in the engine."""
        self._settle()
        self.tiers.pending.drain()  # params written by the last step must have landed
        with self._blocks.block(copies(self.units, resolve(self.units, names), self._full_params)) as view:
            yield view

    def _full_params(self, unit: Unit) -> torch.Tensor:
        """The unit's full flat param buffer on the compute device (every rank's shard)."""
        param = self.shards.read_shard(StateKind.PARAM, unit).to(self.device)
        return param if unit.replicated else self.comm.all_gather(param)

    def train_step(self, batch: Any, step_tokens: int | None = None) -> float:
        """forward + backward + step (the step runs once per `accumulate` calls); the loss."""
        self.vertical.refuse_unknown_loss(batch)
        return self.train_micro_batch(batch, step_tokens).item()  # host sync point: waits for the whole pass

    def train_micro_batch(self, batch: Any, step_tokens: int | None = None) -> torch.Tensor:
        """`train_step` without reading the loss (a detached tensor): a loop that reads the
        micro-batches' losses once per step syncs with the device once per step, not per call."""
        self.model.train()
        if self.vertical.wants(batch):  # opens the engine
            return self.vertical.micro_batch(batch, step_tokens)
        loss = self.forward(batch, step_tokens)
        self.backward(loss)
        self.step()
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, batch: Any, summed: bool = False) -> float:
        """The loss in eval mode (dropout off), without grad; the model's mode is restored. `summed`: as `forward`."""
        was_training = self.model.training
        self.model.eval()
        try:
            return self.forward(batch, summed=summed).item()
        finally:
            self.model.train(was_training)

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, run_dir: str | Path, data: dict[str, Any] | None = None,
                        keep: int | None = None, model: dict[str, Any] | None = None) -> Path:
        """Snapshot every shard at this step into `run_dir/checkpoints/step-<N>` (hard links for
        NVMe-homed state: metadata, not bytes); `data` is the caller's data position, `keep`
        prunes to the newest K. See `tierzero.engine.checkpointing`."""
        self._settle()
        self.vertical.refuse_queued()
        return checkpointing.save(self._checkpointed(), run_dir, data=data, keep=keep, model=model)

    def load_checkpoint(self, path: str | Path) -> Manifest:
        """Continue from a checkpoint: `path` is a `step-<N>` directory, or a run directory (its
        newest intact checkpoint; damaged newer ones are skipped and named in `notes()`). Every
        array is verified first. Returns the manifest (its `data` is the caller's to restore)."""
        if self._broken is not None:
            self._usable()
        path, manifest = checkpointing.find(Path(path), self.comm, self.note)
        self.vertical.abort()  # micro-batches queued before the load belong to no step of it
        if self._open:
            self.tiers.pending.drain()
            checkpointing.restore(self._checkpointed(), path, manifest)
        else:
            self._open_with(lambda: checkpointing.restore(self._checkpointed(), path, manifest))
        return manifest

    def _checkpointed(self) -> checkpointing.Checkpointed:
        return checkpointing.Checkpointed(self.config, self.comm, self.units, self.shards, self.state, self.scaler,
                                     self.param_steps, self.stage, self.device, self.note)

    def note(self, text: str) -> None:
        """Record something the user should hear once (the CLI prints `notes()`)."""
        if text not in self._notes:
            self._notes.append(text)

    def notes(self) -> list[str]:
        """What the engine and its stores could not do as asked, or chose instead, once each."""
        store_notes = getattr(self.tiers.stores.get(Tier.NVME), "notes", [])
        return self._notes + [n for n in store_notes if n not in self._notes]

    # -- state ----------------------------------------------------------------------------------

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under every parameter name (tied aliases included), unit by unit;
        a frozen parameter's stored values, in fp32. The whole model in host memory: for small
        models and tests (large ones: checkpoint and stream out with `tierzero export`)."""
        self._settle()
        return self.shards.master_state_dict(self.units, self.comm)

    def keys(self, kind: StateKind, unit: Unit) -> list[tuple[str, int, int]]:
        """This rank's store keys of `kind` for `unit`, with the shard range each holds."""
        return self.shards.keys(kind, unit)

    def read_shard(self, kind: StateKind, unit: Unit) -> torch.Tensor:
        """A CPU copy of this rank's shard of `kind` for `unit` (inspection, export: `Shards.read_shard`)."""
        self._settle(kind)
        return self.shards.read_shard(kind, unit)

    def _settle(self, kind: StateKind | None = None) -> None:
        """Before shards are read: usable (`read_*` of one kind: as it is), an overlapped step settled, a grad landed."""
        if kind is None:
            self._usable()
        if self.state.stepped_in_backward and self._broken is None:
            self.step()  # overlap_step already updated the shards: settle it before reading them
        if kind is StateKind.GRAD and self._open:
            self.grads.settle()

    def stats(self) -> dict[str, Any]:
        """Per-step counters for metrics.jsonl: bytes per direction, I/O wait, peak bytes."""
        out: dict[str, Any] = dict(self.stats_.take())
        if self._open:
            out.update({f"peak_{k}_bytes": v for k, v in self.tiers.peaks().items()})
        if self.state.last_grad_norm is not None:
            out["grad_norm"] = self.state.last_grad_norm
        if self.scaler.enabled:
            out["loss_scale"] = self.scaler.scale
            out["skipped_steps"] = self.state.skipped_steps
        return out

    # -- internals ------------------------------------------------------------------------------

    def _usable(self) -> None:
        """Open on first use; refuse to go on from a step that stopped half-way."""
        if self._broken is not None:
            raise TierzeroError(f"the engine stopped in the middle of a step ({self._broken}); its tiers "
                                "may hold a partial update, so close it and start again")
        self.open()

    def abort(self, broken: str | None = None) -> None:
        """Drop what a pass holds; `broken`: why it stopped half-way (then `_usable` refuses)."""
        self._broken = broken or self._broken
        self.grads.discard()
        self.optimizer.abort()
        self.vertical.abort()
        if self._root_leaves is not None:
            unbind(self.units[0], self.dtype)
            self._root_leaves = None
        self.scheduler.abort()
