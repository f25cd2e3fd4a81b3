"""The workload: a model's units and how one rank steps them -- what every plan is made for.

One value that the memory model (`memory_model.peak_memory`), the placement planner
(`placement.estimate`, `choose_placement`) and the engine's sizing all read. It is built from
the engine's partition (`Workload.from_units`) or, with no model built, from a shape:
`Workload.from_preset` (a preset's units as the ledger counts them, or a parameter count
shaped like it) and `Workload.from_sizes` (any (name, count) list). Either way its units are
`tierzero.layout.partition.Unit`s padded by partition's own rule, so a plan and a run agree on
every unit's layout. Plain data: it builds no model and never probes the machine.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tierzero.config import (
    OPTIMIZER_KINDS,
    PIECE_NUMEL,
    PREFETCH_DEPTH,
    Placement,
    StateFormat,
    StateKind,
    Tier,
)
from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit, padded_numel
from tierzero.models.presets import ModelArgs
from tierzero.planning.codedbase import CodedBase
from tierzero.planning.ledger import (
    EMBEDDING_UNIT,
    HEAD_UNIT,
    ROOT_UNIT,
    ActivationEstimate,
    UnitSize,
    check_world_size,
    scaled_units,
    units_from_args,
)
from tierzero.planning.statebytes import FP32_STATE, StateBytes
from tierzero.storage.device import DEVICE_ALIGNMENT


def steps_on_gpu(placement: Placement) -> bool:
    """Whether the optimizer steps on the compute device: when every optimizer state lives
    there, or the placement says so (`Placement.optimizer`); otherwise it steps on the CPU,
    beside the host buffers its pieces pass through."""
    return placement.optimizer is Tier.GPU or all(
        placement.home(k) is Tier.GPU for k in OPTIMIZER_KINDS
    )


def brings_up(placement: Placement) -> bool:
    """Whether the step runs on the compute device by choice (`Placement.optimizer`): there a
    state is used in place only where it lives in device memory, and every other one comes up
    (and goes back) through host buffers on the copy streams."""
    return placement.optimizer is Tier.GPU


@dataclass(frozen=True)
class Workload:
    """A model's units in execution order and how one rank trains them.

    `device` is the compute device's kind ("cuda" | "cpu": there the gpu tier is host memory).
    `activations` (from `ledger.activation_memory`) are charged to the compute device; None: not
    counted, for callers that do not know the batch. `tokens_per_step` (per GPU) only feeds the
    step-time model. `stage` is the ZeRO stage, which matters with several ranks only: at 1 and 2
    each rank stores whole units' params, and at 1 with `accumulate` > 1 whole grads too.
    `formats` is how the master and Adam moments are stored (`tierzero.planning.statebytes`);
    `coded`, the NF4 weights of a frozen base stored coded (`tierzero.planning.codedbase`).
    """

    units: tuple[Unit, ...]
    compute_itemsize: int
    grad_itemsize: int = 4  # what grads move as (the engine keeps them fp32 in every tier)
    world_size: int = 1
    device: str = "cuda"
    prefetch_depth: int = PREFETCH_DEPTH
    piece_numel: int = (
        PIECE_NUMEL  # the engine's default (tierzero.planning.streaming: smaller to fit)
    )
    overlap: bool = True  # each unit stepped as its grad arrives in backward (overlap_step)
    overlap_comm: bool = True  # the next call's gather and the last one's reduce-scatter in flight
    stage: int = 3
    accumulate: int = 1  # micro-batches per step
    activations: ActivationEstimate | None = None
    tokens_per_step: int = 0
    formats: StateBytes = FP32_STATE
    coded: CodedBase | None = None

    def __post_init__(self) -> None:
        if not self.units:
            raise ConfigError("a workload needs at least one unit, each with >= 1 parameter")
        check_world_size(self.world_size)
        if self.prefetch_depth < 0:
            raise ConfigError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        assert all(u.world_size == self.world_size for u in self.units), (
            "units laid out for another world size"
        )
        if self.coded is not None and self.world_size > 1:
            raise ConfigError(
                "--quantize-base nf4 trains on one rank for now; drop --gpus or --quantize-base"
            )

    @classmethod
    def from_units(cls, units: Sequence[Unit], compute_itemsize: int, **how: Any) -> Workload:
        """The engine's partition (`tierzero.layout.partition.partition`) as a workload; `how`
        are the other fields. Its units' own world size is the workload's."""
        return cls(
            tuple(units),
            compute_itemsize,
            **{"world_size": units[0].world_size if units else 1, **how},
        )

    @classmethod
    def from_sizes(
        cls,
        sizes: Sequence[UnitSize],
        compute_itemsize: int,
        *,
        world_size: int = 1,
        tied_embeddings: bool = False,
        trainable: Sequence[int] | None = None,
        **how: Any,
    ) -> Workload:
        """Units of the given (name, parameter count), laid out as partition pads them for
        `world_size` ranks. The ledger's names for the built-in model's ends say their kinds (a
        first `embedding` or `root`, a last `head`); every other unit is a block. With
        `tied_embeddings` the head binds the embedding. `trainable` is each unit's trainable
        prefix (`Unit.trainable_numel`; None: every parameter is trained)."""
        check_world_size(world_size)
        if not sizes or any(n < 1 for _, n in sizes):
            raise ConfigError("a workload needs at least one unit, each with >= 1 parameter")
        last = len(sizes) - 1
        units = []
        for i, (name, n) in enumerate(sizes):
            kind = (
                "embedding"
                if i == 0 and name == EMBEDDING_UNIT
                else "root"
                if i == 0 and name == ROOT_UNIT
                else "head"
                if i == last and name == HEAD_UNIT
                else "block"
            )
            padded = padded_numel(n, world_size)
            units.append(
                Unit(
                    i,
                    name,
                    kind,
                    None,
                    numel=n,
                    padded_numel=padded,
                    world_size=world_size,
                    trainable_numel=padded if trainable is None else trainable[i],
                )
            )
        if tied_embeddings and units[0].kind == "embedding" and units[-1].kind == "head":
            units[-1].uses_with = (0,)
        return cls(tuple(units), compute_itemsize, world_size=world_size, **how)

    @classmethod
    def from_preset(
        cls, args: ModelArgs, compute_itemsize: int, *, numel: int | None = None, **how: Any
    ) -> Workload:
        """The built-in model of shape `args` as the engine partitions it (embedding, blocks,
        head); with `numel`, a model of that many parameters shaped like it."""
        sizes = units_from_args(args) if numel is None else scaled_units(numel, args)
        return cls.from_sizes(sizes, compute_itemsize, tied_embeddings=args.tie_embeddings, **how)

    @property
    def tied_embeddings(self) -> bool:
        return any(u.uses_with for u in self.units)

    @property
    def replicated(self) -> bool:
        """Stage 1/2 with several ranks: each rank's param home holds whole units."""
        return self.world_size > 1 and self.stage <= 2

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def shard_numel(self) -> int:
        """Parameters one rank holds of every unit (padding aside: what moves)."""
        return sum(math.ceil(u.numel / self.world_size) for u in self.units)

    @property
    def param_numel(self) -> int:
        """Params one rank stores and fetches: its shards, or whole units at stage 1/2."""
        return self.numel if self.replicated else self.shard_numel

    @property
    def state_shard_numel(self) -> int:
        """Parameters one rank holds grads and optimizer states for: frozen ones have none
        (rank 0's share of each unit's trainable prefix, the largest)."""
        return sum(min(math.ceil(u.numel / self.world_size), u.trainable_numel) for u in self.units)

    @property
    def largest_unit_numel(self) -> int:
        return max(u.numel for u in self.units)

    def nbytes(self, kind: StateKind, numel: int = 1) -> int:
        """Bytes of `numel` elements of `kind` stored as one run (int8 moments: with a scale
        per started block, so per parameter only over whole blocks)."""
        return self.formats.nbytes(kind, numel, self.compute_itemsize, self.grad_itemsize)

    def device_home_nbytes(self, kind: StateKind, numel: int) -> int:
        """Bytes a unit's run of `numel` elements of state `kind` takes as device-pool keys: one
        per piece, each leased at the pool's alignment (an int8 piece's scales unalign it; every
        other kind's pieces are multiples of 2048 elements, so their run is counted as it is)."""
        if (
            kind not in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
            or self.formats.optimizer_state is not StateFormat.INT8
        ):
            return self.nbytes(kind, numel)
        full, rest = divmod(numel, self.piece_numel)

        def aligned(n: int) -> int:
            return -(-self.nbytes(kind, n) // DEVICE_ALIGNMENT) * DEVICE_ALIGNMENT

        return full * aligned(self.piece_numel) + (aligned(rest) if rest else 0)

    def state_nbytes(self, kind: StateKind) -> int:
        """One rank's bytes of `kind` for the parameters it holds states for
        (`state_shard_numel`, each unit's run stored on its own)."""
        return sum(
            self.nbytes(kind, min(math.ceil(u.numel / self.world_size), u.trainable_numel))
            for u in self.units
        )

    def stored_param_nbytes(self) -> list[int]:
        """Per unit, the bytes of the param one rank stores (`param_numel`'s share of it): in
        the compute dtype, or a coded base's pieces as stored. What its home holds, a fetch
        reads, stages and caches; its device buffer holds the decoded values."""
        return [
            self.coded.shard_nbytes(u, self.piece_numel, self.compute_itemsize)
            if self.coded is not None and self.coded.is_coded(u)
            else (u.padded_numel if self.replicated else u.shard_numel) * self.compute_itemsize
            for u in self.units
        ]

    def param_nbytes(self, units: Sequence[Unit] | None = None) -> int:
        """The bytes of `units`' params (default: all) one rank moves: `param_numel`'s in the
        compute dtype (padding aside), a coded unit's as stored."""
        coded = self.coded
        return sum(
            coded.shard_nbytes(u, self.piece_numel, self.compute_itemsize)
            if coded is not None and coded.is_coded(u)
            else (u.numel if self.replicated else math.ceil(u.numel / self.world_size))
            * self.compute_itemsize
            for u in (self.units if units is None else units)
        )

    def coded_pieces(self) -> dict[int, Counter[int]]:
        """The param pieces of each coded unit as stored (bytes -> how many), by unit index."""
        if self.coded is None:
            return {}
        coded = self.coded
        return {
            u.index: coded.piece_counts(u, self.piece_numel, self.compute_itemsize)
            for u in self.units
            if coded.is_coded(u)
        }

    def one_weight(self, placement: Placement) -> bool:
        """Whether the param and the master are one tensor under `placement`: one bf16 weight
        (`StateBytes.one_weight`) homed on one tier, each rank's shard of both the same
        (not stage 1/2, where params are replicated and masters partitioned)."""
        return (
            self.formats.one_weight and placement.param is placement.master and not self.replicated
        )
