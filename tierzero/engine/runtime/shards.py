"""`Shards`: this rank's stored state, key by key: the one owner of shard reads and writes
outside the step (materialising the model, inspection, export, checkpoints).

Each state kind of a unit is stored in its home tier as pieces (`tierzero.layout.keys`);
`keys` names them with the range of the shard each holds. Reads fill CPU tensors (verified
where stored on disk); writes take CPU tensors, staged through a leased host buffer for NVMe.
The step's own traffic (prefetch, grads, the optimizer's pipeline) never passes here. Keys hold
their stored format (`tierzero.compact.formats`: bf16 or int8 master and moments); shards are
fp32 here, each piece decoded or encoded on its own. A param shard with an NF4 base is stored
coded (`tierzero.models.nf4_shard`): its keys' ranges are in its stored layout, and reads and
puts of whole shards decode and encode it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tierzero.compact.formats import StateFormats
from tierzero.config import DType, Placement, StateKind, Tier
from tierzero.distributed.comm import Comm
from tierzero.engine.runtime.binding import detach_params
from tierzero.engine.runtime.tiers import Tiers
from tierzero.layout.keys import state_keys
from tierzero.layout.partition import Unit
from tierzero.models.init import WeightFiles, flat_unit
from tierzero.models.nf4_shard import CodedShard
from tierzero.storage.base import aligned_empty


@dataclass(frozen=True)
class Shards:
    """This rank's stored state under a placement: what every read and write here is keyed by."""

    tiers: Tiers
    placement: Placement
    rank: int
    piece_numel: int
    dtype: torch.dtype  # the compute dtype params are stored in
    grad_dtype: DType = DType.FP32  # what grads are stored in (`Sizing.grad_dtype`)
    coded: dict[int, CodedShard] = field(default_factory=dict)  # units whose base is NF4

    @property
    def formats(self) -> StateFormats:
        """How master, moments and grads are stored."""
        return StateFormats.of(self.tiers.formats, self.grad_dtype)

    def keys(self, kind: StateKind, unit: Unit) -> list[tuple[str, int, int]]:
        """This rank's store keys of `kind` for `unit`, with the shard range each holds (none for
        a master that is the param: `StateFormats.master_is_param`)."""
        if kind is StateKind.MASTER and self.formats.master_is_param(self.dtype):
            return []
        keys = state_keys(kind, unit, self.rank, self.piece_numel, self.placement.home(kind))
        coded = self.coded.get(unit.index) if kind is StateKind.PARAM else None
        if coded is None:
            return keys
        return [(key, *coded.stored_range(a, b)) for key, a, b in keys]

    def read_shard(self, kind: StateKind, unit: Unit) -> torch.Tensor:
        """A CPU copy of this rank's shard of `kind` for `unit`: for kinds other than `param`,
        its trainable prefix (`Unit.state_numel`); for `param`, what this rank stores (the
        whole unit when `unit.replicated`)."""
        if kind is StateKind.MASTER and self.formats.master_is_param(self.dtype):
            lo = unit.param_offset(self.rank)
            return self.read_shard(StateKind.PARAM, unit)[
                lo : lo + unit.state_numel(self.rank)
            ].float()
        coded = self.coded.get(unit.index) if kind is StateKind.PARAM else None
        if coded is not None:
            stored = aligned_empty(coded.stored_numel, self.dtype)
            for key, a, b in self.keys(kind, unit):
                self.read_key(kind, key, stored[a:b])
            return coded.decode(stored, aligned_empty(unit.param_numel, self.dtype))
        if kind is StateKind.PARAM:
            out = aligned_empty(unit.param_numel, self.dtype)
        else:
            out = aligned_empty(unit.state_numel(self.rank), torch.float32)
        for key, a, b in self.keys(kind, unit):
            if kind is StateKind.PARAM or self.formats.dtype(kind) == torch.float32:
                self.read_key(kind, key, out[a:b])
            else:
                stored = self.empty(kind, b - a)
                self.read_key(kind, key, stored)
                self.formats.decode(kind, stored, out[a:b])
        return out

    def empty(self, kind: StateKind, numel: int) -> torch.Tensor:
        """An aligned CPU tensor for one stored key of `kind` holding `numel` values."""
        return (
            aligned_empty(numel, self.dtype)
            if kind is StateKind.PARAM
            else self.formats.empty(kind, numel)
        )

    def read_key(self, kind: StateKind, key: str, out: torch.Tensor) -> None:
        """Fill the CPU tensor `out` from one stored key of `kind` (verified where stored on
        disk)."""
        store = self.tiers.stores[self.placement.home(kind)]
        if store.capabilities.zero_copy:
            out.copy_(store.view(key))
        else:
            self.tiers.run(store.read_into(key, out, verify=True))

    def put_shard(self, kind: StateKind, unit: Unit, src: torch.Tensor) -> None:
        """Write this rank's shard of `kind` for `unit` (a CPU tensor; fp32 but for params) to
        its home tier, each piece in its stored format."""
        coded = self.coded.get(unit.index) if kind is StateKind.PARAM else None
        if coded is not None:
            src = coded.encode(src)
        for key, a, b in self.keys(kind, unit):
            stored = src[a:b] if kind is StateKind.PARAM else self.formats.encode(kind, src[a:b])
            self.put_key(kind, key, stored)

    def put_key(self, kind: StateKind, key: str, src: torch.Tensor) -> None:
        """Write one stored key of `kind` (a CPU tensor) to its home tier; an NVMe write is
        staged through a leased host buffer, given back once it has landed (`tiers.pending`).
        A memory tier's old copy goes first: nothing reads it while state is put (an open or a
        restore), and a write beside it would need its room twice in a pool sized exactly."""
        store = self.tiers.stores[self.placement.home(kind)]
        if self.placement.home(kind) is Tier.NVME:
            staged = self.tiers.lease_host(src.numel() * src.element_size()).view(src.dtype)
            staged.copy_(src)
            future = self.tiers.submit(store.write(key, staged))
            self.tiers.pending.add(
                future, lambda ok: self.tiers.host_pool.give_back(staged.view(torch.uint8))
            )
        else:
            self.tiers.run(store.delete(key))
            self.tiers.run(store.write(key, src))

    def materialise(self, model: nn.Module, units: list[Unit], seed: int, weights: Any) -> None:
        """Every unit's initial state into its home, one unit at a time (peak host memory about
        one unit): its weights (from `weights` files, the built model, or initialised from
        `seed`), master, zero moments and grads. The engine owns the weights from then on."""
        files = WeightFiles(weights) if weights is not None else None
        for unit in units:
            lo, hi = unit.shard_range(self.rank)
            flat = flat_unit(model, unit, seed, files)
            shard = flat[lo:hi].contiguous()
            detach_params(unit, self.dtype, self.tiers.device)
            self.put_shard(StateKind.MASTER, unit, shard)
            self.put_shard(
                StateKind.PARAM, unit, (flat if unit.replicated else shard).to(self.dtype)
            )
            zeros = torch.zeros_like(shard)
            for kind in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ, StateKind.GRAD):
                self.put_shard(kind, unit, zeros)
            self.tiers.pending.drain()
        if Tier.NVME in self.tiers.stores:
            self.tiers.run(self.tiers.stores[Tier.NVME].flush())

    def master_state_dict(self, units: list[Unit], comm: Comm) -> dict[str, torch.Tensor]:
        """fp32 master weights under every parameter name (tied aliases included), unit by unit;
        a frozen parameter's stored values, in fp32 (`Engine.master_state_dict`)."""
        out: dict[str, torch.Tensor] = {}
        for unit in units:
            master = self.read_shard(StateKind.MASTER, unit)
            if unit.has_frozen:  # the shard's frozen rest has params only
                lo = unit.param_offset(self.rank)
                param = self.read_shard(StateKind.PARAM, unit)[lo : lo + unit.shard_numel]
                master = torch.cat([master, param[master.numel() :].float()])
            if comm.world_size > 1:  # every rank's shard, end to end: the full flat buffer
                master = comm.all_gather(master.to(comm.device)).cpu()
            for slot in unit.slots:
                value = master[slot.offset : slot.end].view(slot.shape).clone()
                for name in slot.names:
                    out[name] = value
        return out

    def full_params(self, unit: Unit, comm: Comm, device: torch.device) -> torch.Tensor:
        """The unit's full flat param buffer on `device` (every rank's shard: `Engine.gathered`)."""
        param = self.read_shard(StateKind.PARAM, unit).to(device)
        return param if unit.replicated else comm.all_gather(param)
