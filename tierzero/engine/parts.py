"""`EngineParts`: what an engine builds once, before any I/O; `RankLayout`: what this rank
holds and how; `StepCounters`: the step's counters.

Building decides and validates without I/O (`Sizing`: placement, stage, piece size, budgets)
and makes the long-lived objects that `Engine.open` then opens (the tiers) or fills (the stored
shards). The Engine keeps the record; the parts it builds over open tiers
(`runtime.opened.OpenParts`: the swap runner, the grad shards, the optimizer, ...) each receive
the few collaborators they use, named in their signatures -- mostly the `RankLayout`, the
`Tiers` and a config section -- never this record or the Engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tierzero.config import TORCH_DTYPES, Config, Placement, StateKind, Tier
from tierzero.distributed.comm import Comm
from tierzero.distributed.launch import local_world_size
from tierzero.engine.runtime.layout import RankLayout
from tierzero.engine.runtime.shards import Shards
from tierzero.engine.runtime.tiers import Tiers
from tierzero.engine.runtime.transfers import TransferStats
from tierzero.engine.sizing import Sizing
from tierzero.engine.step.counters import StepCounters
from tierzero.engine.step.side import step_side
from tierzero.engine.step.skipped import SkippedSteps
from tierzero.engine.step.state import StepState
from tierzero.errors import ConfigError
from tierzero.layout.partition import partition, replicate_params
from tierzero.models.nf4_shard import coded_base
from tierzero.planning.workload import brings_up, steps_on_gpu
from tierzero.precision import DynamicLossScaler, compute_dtype, resolve_dtype


@dataclass(frozen=True)
class EngineParts:
    """What an engine built: its model, decisions and long-lived objects. The Engine keeps it;
    each part it builds receives only the collaborators it names."""

    model: nn.Module
    config: Config  # resolved: the piece size and prefetch depth this rank runs with
    device: torch.device
    layout: RankLayout
    local_ranks: int  # ranks on this machine: they share its RAM and drives
    sizing: Sizing
    stage_reason: str
    step_reason: str  # where the optimizer steps, and why (`planning.stepdevice`)
    overlap: bool  # units are stepped in backward (overlap_step)
    counters: StepCounters
    tiers: Tiers
    shards: Shards  # this rank's stored state, key by key
    # the model's parameter names in its order, as built (the global norm sums so)
    param_order: list[str]
    _notes: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, model: nn.Module, config: Config) -> EngineParts:
        """Partition `model`, decide where its state lives and how it streams, size the
        (unopened) tiers' pools and make the shards: validation only, nothing is allocated or
        written."""
        device = config.tiering.resolved_device()
        dtype = compute_dtype(resolve_dtype(config.precision.dtype, device), device)
        comm = Comm(device, TORCH_DTYPES[config.partitioning.grad_reduce_dtype])
        local_ranks = local_world_size(comm)
        units = partition(model, comm.world_size, config.streaming.units)
        precision = config.precision
        fp16 = dtype == torch.float16
        scaler = DynamicLossScaler(precision.loss_scale, precision.loss_scale_window, enabled=fp16)
        overlap = resolve_overlap(config, scaler.enabled)
        sizing = Sizing(config, device, dtype, units, comm.world_size, local_ranks, overlap)
        # `offload auto`: for the forced stage, else stage 3's
        placement = sizing.placement(config.partitioning.stage or 3)
        check_runnable(placement)
        stage, stage_reason = sizing.stage(placement)
        placement, step_reason = step_side(sizing, placement, stage)
        config = sizing.resolve(placement, stage)  # piece size and prefetch depth left unset
        replicate_params(units, stage <= 2)
        homes = {placement.home(k) for k in StateKind}
        rank = comm.rank if comm.world_size > 1 else None
        tiers = Tiers(
            config.tiering,
            config.streaming,
            config.formats,
            device,
            homes,
            rank,
            TransferStats(),
            local_ranks,
        )
        tiers.check_paths()  # reads metadata only: `open` makes the directories
        grad_dtype = TORCH_DTYPES[sizing.grad_dtype]
        piece_numel = config.streaming.piece_numel
        layout = RankLayout(units, placement, stage, piece_numel, dtype, grad_dtype, comm)
        base = config.formats.quantize_base
        coded = coded_base(base, piece_numel, units, placement.param, comm.world_size, dtype)
        shards = Shards(tiers, placement, comm.rank, piece_numel, dtype, sizing.grad_dtype, coded)
        # the pools' budgets, or a refusal naming the shortfall
        sizing.check(tiers, placement, stage)
        counters = StepCounters(StepState(), scaler, SkippedSteps(units))
        return cls(
            model,
            config,
            device,
            layout,
            local_ranks,
            sizing,
            stage_reason,
            step_reason,
            overlap,
            counters,
            tiers,
            shards,
            [name for name, _ in model.named_parameters()],
        )

    def note(self, text: str) -> None:
        """Record something the user should hear once (the CLI prints `Engine.notes()`)."""
        if text not in self._notes:
            self._notes.append(text)

    def notes(self) -> list[str]:
        """This engine's notes, then its NVMe store's, once each."""
        store_notes = getattr(self.tiers.stores.get(Tier.NVME), "notes", [])
        return self._notes + [n for n in store_notes if n not in self._notes]

    def metrics(self, peaks: bool) -> dict[str, Any]:
        """The step's counters, taken (bytes per direction, I/O wait), with the tiers' `peaks`
        (open tiers only), the grad norm and the fp16 loss scale where there are any."""
        out: dict[str, Any] = dict(self.tiers.stats.take())
        if peaks:
            out.update({f"peak_{k}_bytes": v for k, v in self.tiers.peaks().items()})
        state, scaler = self.counters.state, self.counters.scaler
        if state.last_grad_norm is not None:
            out["grad_norm"] = state.last_grad_norm
        if scaler.enabled:
            out["loss_scale"] = scaler.scale
            out["skipped_steps"] = state.skipped_steps
        return out


def resolve_overlap(config: Config, fp16: bool) -> bool:
    """Whether units are stepped during backward: on by default wherever that is free.

    fp16 never (the step waits for the overflow check). With clipping it is exact when asked
    for (each fired clip re-steps every unit from its kept generation, `Stepper`), and on
    by default when the user opts in to clipping by the previous step's norm (`clip_previous_norm`).
    """
    clip = config.optimizer.clip_grad_norm is not None
    if config.optimizer.clip_previous_norm and not clip:
        raise ConfigError("clip_previous_norm needs clip_grad_norm; set both or neither")
    if config.execution.overlap_step and fp16:
        raise ConfigError(
            "overlap_step cannot be exact with fp16: each unit's step would need the "
            "overflow check first; turn one of them off"
        )
    free = not fp16 and (not clip or config.optimizer.clip_previous_norm)
    return free if config.execution.overlap_step is None else config.execution.overlap_step


def check_runnable(placement: Placement) -> None:
    """Refuse, at construction, a placement the engine cannot run: with master and both moments
    on the GPU the optimizer steps there, and grads homed on NVMe would be read straight into
    device memory, which the NVMe store refuses (it moves host buffers only). Refused on every
    device alike, so a config tried on the CPU runs on a GPU."""
    if (
        steps_on_gpu(placement)
        and not brings_up(placement)  # a step on the device by choice stages them
        and placement.home(StateKind.GRAD) is Tier.NVME
    ):
        raise ConfigError(
            f"placement {placement.describe()} steps the optimizer on the GPU (master and both "
            "moments live there) but homes grads on nvme, which the GPU step cannot read; "
            'home grads on host (grad = "host") or move master and moments off the GPU'
        )
