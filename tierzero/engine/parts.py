"""`EngineParts`: the one record of what an engine's parts share, built once with the engine.

The swap runner, the grad shards, the optimizer, the param sync, the stepper and the vertical
schedule each take this record instead of the Engine or a run of positional arguments (rank,
piece size, home tier, ...), so what one part reads of another is a field here, never an
engine member. Building it decides and validates without I/O (`Sizing`: placement, stage,
piece size, budgets) and makes the long-lived objects that `Engine.open` then opens (the tiers)
or fills (the stored shards). What `open` builds over open tiers is `runtime.opened.OpenParts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tierzero.config import TORCH_DTYPES, Config, Placement, StateKind, Tier
from tierzero.distributed.comm import Comm
from tierzero.distributed.launch import local_world_size
from tierzero.engine.runtime.shards import Shards
from tierzero.engine.runtime.tiers import Tiers
from tierzero.engine.runtime.transfers import TransferStats
from tierzero.engine.sizing import Sizing, check_runnable, resolve_overlap
from tierzero.engine.step.skipped import SkippedSteps
from tierzero.engine.step.state import StepState
from tierzero.layout.partition import Unit, partition, replicate_params
from tierzero.models.nf4_shard import coded_base
from tierzero.precision import DynamicLossScaler, compute_dtype, resolve_dtype


@dataclass(frozen=True)
class EngineParts:
    """One engine's model, decisions and long-lived objects (the counters and stores change in place)."""

    model: nn.Module
    config: Config  # resolved: the piece size and prefetch depth this rank runs with
    device: torch.device
    dtype: torch.dtype  # the compute dtype
    comm: Comm
    local_ranks: int  # ranks on this machine: they share its RAM and drives
    units: list[Unit]
    param_order: list[str]  # the model's parameter names, in its order (the global norm sums so)
    sizing: Sizing
    placement: Placement
    stage: int
    stage_reason: str
    overlap: bool  # units are stepped in backward (overlap_step)
    scaler: DynamicLossScaler
    transfers: TransferStats
    tiers: Tiers
    shards: Shards  # this rank's stored state, key by key
    state: StepState  # the step counters
    param_steps: SkippedSteps
    _notes: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, model: nn.Module, config: Config) -> EngineParts:
        """Partition `model`, decide where its state lives and how it streams, size the
        (unopened) tiers' pools and make the shards: validation only, nothing is allocated or written."""
        device = config.tiering.resolved_device()
        dtype = compute_dtype(resolve_dtype(config.precision.dtype, device), device)
        comm = Comm(device, TORCH_DTYPES[config.partitioning.grad_reduce_dtype])
        local_ranks = local_world_size(comm)
        units = partition(model, comm.world_size, config.streaming.units)
        scaler = DynamicLossScaler(
            config.precision.loss_scale,
            config.precision.loss_scale_window,
            enabled=dtype == torch.float16,
        )
        overlap = resolve_overlap(config, scaler.enabled)
        sizing = Sizing(config, device, dtype, units, comm.world_size, local_ranks, overlap)
        placement = sizing.placement(
            config.partitioning.stage or 3
        )  # `offload auto`: for the forced stage, else stage 3's
        check_runnable(placement)
        stage, stage_reason = sizing.stage(placement)
        config = sizing.resolve(placement, stage)  # piece size and prefetch depth left unset
        replicate_params(units, stage <= 2)
        transfers = TransferStats()
        tiers = Tiers(
            config.tiering,
            config.streaming,
            config.formats,
            device,
            {placement.home(k) for k in StateKind},
            comm.rank if comm.world_size > 1 else None,
            transfers,
            local_ranks,
        )
        tiers.check_paths()  # reads metadata only: `open` makes the directories
        coded = coded_base(config, units, placement.param, comm.world_size, dtype)
        shards = Shards(
            tiers,
            placement,
            comm.rank,
            config.streaming.piece_numel,
            dtype,
            sizing.grad_dtype,
            coded,
        )
        sizing.check(
            tiers, placement, stage
        )  # the pools' budgets, or a refusal naming the shortfall
        return cls(
            model,
            config,
            device,
            dtype,
            comm,
            local_ranks,
            units,
            [name for name, _ in model.named_parameters()],
            sizing,
            placement,
            stage,
            stage_reason,
            overlap,
            scaler,
            transfers,
            tiers,
            shards,
            StepState(),
            SkippedSteps(units),
        )

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def piece_numel(self) -> int:
        return self.config.streaming.piece_numel

    @property
    def grad_dtype(self) -> torch.dtype:
        """What grads leave the device in and rest in (`Sizing.grad_dtype`)."""
        return TORCH_DTYPES[self.sizing.grad_dtype]

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
        out: dict[str, Any] = dict(self.transfers.take())
        if peaks:
            out.update({f"peak_{k}_bytes": v for k, v in self.tiers.peaks().items()})
        if self.state.last_grad_norm is not None:
            out["grad_norm"] = self.state.last_grad_norm
        if self.scaler.enabled:
            out["loss_scale"] = self.scaler.scale
            out["skipped_steps"] = self.state.skipped_steps
        return out
