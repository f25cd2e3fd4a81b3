"""One rank's sizing: its budgets, the memory model of its units, and what they decide.

At construction the engine asks this module where state lives (`offload auto`: the planner's
best placement among those whose peaks fit the budgets), which ZeRO stage to run (the least
communication whose replicated state fits), the piece size and prefetch depth the user left to
it (the defaults where they fit, else the first that fits on `tierzero.planning.streaming`'s
ladder), and whether the pools' budgets hold what the one memory model
(`tierzero.planning.memory_model`) predicts; at the first training forward, what the batch's
activations take from them (not known before: the streaming choice leaves them what the budget
has beyond the rest). It decides and refuses; the engine only wires the answers in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tierzero.config import (
    TORCH_DTYPES,
    Config,
    DType,
    Offload,
    Placement,
    Recompute,
    StateKind,
    Tier,
)
from tierzero.engine.runtime.kept import Keeping, batch_tokens
from tierzero.engine.runtime.layout import RankLayout
from tierzero.engine.runtime.tiers import Tiers
from tierzero.engine.shortfall import check_pools, tier_name
from tierzero.errors import ConfigError
from tierzero.layout.partition import Unit, forward_only
from tierzero.models.presets import ModelArgs
from tierzero.planning.codedbase import CodedBase
from tierzero.planning.ledger import ActivationEstimate, activation_memory
from tierzero.planning.machine import default_budgets, free_disk_bytes
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.peaks import MemoryModel, format_bytes
from tierzero.planning.recompute import choose_kept, with_kept
from tierzero.planning.statebytes import StateBytes, grad_dtype
from tierzero.planning.streaming import Shortfall, Streaming, choose_streaming, ladder
from tierzero.planning.workload import Workload
from tierzero.storage.base import BudgetExceededError


@dataclasses.dataclass(eq=False)
class Sizing:
    """The memory model of one rank's units under an engine's config; `local_ranks` share the
    machine's RAM and drives (their default budgets are split)."""

    config: Config
    device: torch.device
    dtype: torch.dtype
    units: list[Unit]
    world_size: int
    local_ranks: int
    overlap: bool
    # decided as the engine runs: the units that keep their graph (`reserve_activations`), the
    # first training batch's activations once reserved, what the pools are sized by (`check`,
    # `reserve_activations`), and `walks()` once asked
    kept: frozenset[int] = dataclasses.field(default=frozenset(), init=False)
    activations: ActivationEstimate | None = dataclasses.field(default=None, init=False)
    current: MemoryModel | None = dataclasses.field(default=None, init=False)
    _walks: bool | None = dataclasses.field(default=None, init=False)

    def __post_init__(self) -> None:
        # the streaming settings the user gave: a refusal suggests lowering those
        self.given = [
            name
            for name, v in (
                ("piece_numel", self.config.streaming.piece_numel),
                ("--prefetch-depth", self.config.streaming.prefetch_depth),
            )
            if v is not None
        ]
        # an NF4 base counted as stored (`tierzero.planning.codedbase`), where it can be one:
        # `models.nf4_shard.coded_base` refuses the rest in its own sentences
        self.coded: CodedBase | None = None
        if self.config.formats.quantize_base == "nf4" and self.world_size == 1:
            try:
                self.coded = CodedBase.of(self.units)
            except ConfigError:
                self.coded = None

    @property
    def compute(self) -> DType:
        return next(d for d, t in TORCH_DTYPES.items() if t == self.dtype)

    @property
    def formats(self) -> StateBytes:
        """How this run stores its master and moments, as the memory model counts them."""
        return StateBytes.for_compute(
            self.config.formats.optimizer_state, self.config.formats.master, self.compute
        )

    @property
    def grad_dtype(self) -> DType:
        """The dtype grads leave the device in and rest in their home (`statebytes.grad_dtype`)."""
        return grad_dtype(
            self.compute, self.config.execution.accumulate, self.config.execution.schedule
        )

    def workload(
        self,
        stage: int,
        activations: ActivationEstimate | None = None,
        streaming: Streaming | None = None,
    ) -> Workload:
        """This rank's units and how it steps them at `stage` (activations when known) with
        `streaming` (default: the ladder's top where the config leaves a setting open): what the
        memory model and the planner are asked about, as `tierzero plan` asks them."""
        c = self.config
        s = streaming or ladder(c.streaming.piece_numel, c.streaming.prefetch_depth)[0]
        grad_itemsize = TORCH_DTYPES[self.grad_dtype].itemsize
        return Workload.from_units(
            self.units,
            self.dtype.itemsize,
            grad_itemsize=grad_itemsize,
            device="cpu" if self.device.type == "cpu" else "cuda",
            prefetch_depth=s.prefetch_depth,
            piece_numel=s.piece_numel,
            overlap=self.overlap,
            overlap_comm=c.partitioning.overlap_comm,
            stage=stage,
            accumulate=c.execution.accumulate,
            activations=activations,
            formats=self.formats,
            coded=self.coded,
        )

    def memory(
        self, placement: Placement, stage: int, activations: ActivationEstimate | None = None
    ) -> MemoryModel:
        """This rank's share of the memory model at `placement` and `stage` (activations when
        known), streaming as `streaming` chooses: what its own pools and budgets hold."""
        return peak_memory(
            self.workload(stage, activations, self.streaming(placement, stage)), placement
        ).per_rank()

    def walks(self) -> bool:
        """Whether the settings left open are chosen on the ladder: only where, at the defaults,
        nothing fits this rank's budgets at stage 3 (the least replicated) -- the placement
        configured or, for `offload auto`, any candidate. Budgets the defaults fit keep every
        choice they made before (placement, stage, streaming); a forced stage they do not fit
        is refused where stage 3 fits them."""
        c = self.config
        if self._walks is None and None not in (
            c.streaming.piece_numel,
            c.streaming.prefetch_depth,
        ):
            self._walks = False  # nothing left open
        elif self._walks is None:
            from tierzero.planning.placement import candidate_placements

            auto = c.tiering.placement is None and c.tiering.offload is Offload.AUTO
            at_defaults = self.workload(3)  # the ladder's top, the values given kept
            self._walks = not any(
                fits(peak_memory(at_defaults, p).per_rank(), self.budgets())
                for p in (
                    candidate_placements(self.coded is not None)
                    if auto
                    else [c.tiering.resolved_placement()]
                )
            )
        return self._walks

    def streaming(self, placement: Placement, stage: int) -> Streaming:
        """The configured piece size and prefetch depth; where the config leaves one open
        (None), the defaults unless `walks()`, else the first rung of the ladder whose memory
        model at `placement` and `stage` fits this rank's memory budgets, else the one the
        shortfall was counted at (`check` then refuses it with the figures)."""
        c = self.config
        if not self.walks():
            return ladder(c.streaming.piece_numel, c.streaming.prefetch_depth)[0]
        memory_budgets = {
            t: b for t, b in self.budgets().items() if t is not Tier.NVME
        }  # streaming saves no disk
        choice = choose_streaming(
            self.workload(stage),
            placement,
            memory_budgets,
            piece_numel=c.streaming.piece_numel,
            prefetch_depth=c.streaming.prefetch_depth,
            per_rank=True,
        )
        return choice.streaming if isinstance(choice, Shortfall) else choice

    def resolve(self, placement: Placement, stage: int) -> Config:
        """The config with the piece size and prefetch depth this rank runs with at `placement`
        and `stage` (`streaming`), which sizing and the engine use from then on."""
        s = self.streaming(placement, stage)
        self.config = self.config.replace(
            piece_numel=s.piece_numel, prefetch_depth=s.prefetch_depth
        )
        return self.config

    def budgets(self) -> dict[Tier, int]:
        """This rank's budget per tier, as `offload auto` and the stage choice weigh them."""
        host, gpu = default_budgets(self.device, self.local_ranks)
        budgets = {
            Tier.HOST: self.config.tiering.host_budget or host,
            Tier.GPU: self.config.tiering.gpu_budget or gpu,
            Tier.NVME: self.nvme_free() * len(self.config.tiering.nvme_path) // self.local_ranks,
        }
        if self.device.type == "cpu" and self.config.tiering.gpu_budget is None:
            del budgets[Tier.GPU]  # the gpu tier is host memory, inside the host budget
        return budgets

    def placement(self, stage: int) -> Placement:
        """The configured placement, or for `offload auto` the planner's best among those whose
        peaks at `stage` fit the budgets."""
        if (
            self.config.tiering.placement is not None
            or self.config.tiering.offload is not Offload.AUTO
        ):
            return self.config.tiering.resolved_placement()
        from tierzero.planning.placement import candidate_placements, choose_placement, load_profile

        budgets = self.budgets()
        fitting = [
            p
            for p in candidate_placements(self.coded is not None)
            if fits(self.memory(p, stage), budgets)
        ]
        if not fitting:
            sizes = ", ".join(
                f"{tier_name(t, self.device)} {format_bytes(n)}"
                for t, n in budgets.items()
                if t is not Tier.NVME
            )
            least = (
                " even at the least piece size and prefetch depth tierzero chooses"
                if self.walks() and not self.given
                else ""
            )
            flags = "--host-budget" if Tier.GPU not in budgets else "--host-budget or --gpu-budget"
            raise ConfigError(
                f"no placement fits the budgets ({sizes}, nvme "
                f"{budgets[Tier.NVME] / 1e9:.1f} GB free){least}; raise {flags}, or free disk space"
            )
        return choose_placement(
            self.workload(stage),
            gpu_budget=None,
            host_budget=None,
            nvme_free=None,
            candidates=fitting,
            profile=load_profile(self.config.tiering.profile)
            if self.config.tiering.profile
            else None,
        ).placement

    def stage(self, placement: Placement) -> tuple[int, str]:
        """The ZeRO stage and why: the forced one (`Config.stage`), refused in one sentence when
        its replicated state does not fit this rank's budgets; else the least communication that
        fits -- stage 1 (with `accumulate` > 1), then 2 -- or stage 3. One rank: stage 3 (all
        three are the same run)."""
        from tierzero.planning.placement import choose_stage

        forced = self.config.partitioning.stage
        if self.world_size == 1:
            return forced or 3, "one rank"
        budgets = self.budgets()
        if forced is not None:
            mem = self.memory(placement, forced)
            if forced <= 2 and not fits(mem, budgets):
                tier = next(t for t, n in mem.needs().items() if t in budgets and n > budgets[t])
                fix = {Tier.HOST: "raise --host-budget", Tier.GPU: "raise --gpu-budget"}.get(
                    tier, "free disk space"
                )
                raise ConfigError(
                    f"--stage {forced} keeps every unit's params"
                    f"{' and grads' if forced == 1 else ''} whole on each rank, which needs "
                    f"{mem.needs()[tier] / 1e6:.1f} MB of {tier.value} per rank where its budget "
                    f"is {budgets[tier] / 1e6:.1f} MB; use --stage 3 (or leave --stage unset to "
                    f"choose), or {fix}"
                )
        return choose_stage(
            lambda stage: fits(self.memory(placement, stage), budgets),
            self.world_size,
            self.config.execution.accumulate,
            forced,
        )

    def check(self, tiers: Tiers, placement: Placement, stage: int) -> MemoryModel:
        """Size the pools from the memory model and refuse, before anything is written, budgets
        or disks too small for this model: each pool's budget, less what torch allocates beside
        it (unit grads; the batch's activations are taken at the first forward), must hold the
        homes and the working set the model predicts at the configured read-ahead. On the CPU
        device the device pool's budget is carved out of the host budget. The model it checked.
        """
        memory = self.memory(placement, stage)
        tiers.share_budgets(memory.tiers[Tier.GPU].pool_bytes)
        for tier, need in _unpooled(memory).items():
            tiers.reserve(tier, need)
        check_pools(tiers, memory, "", self.config.streaming, self.given)
        # the host pool's blocks, pinned at open; with room, the LRU cache's too where the host
        # budget is final (on the CPU device the first forward takes the activations from it)
        tiers.host_blocks = memory.host_provision(
            tiers.host_budget if self.device.type == "cuda" else 0
        )
        if Tier.NVME in {placement.home(k) for k in StateKind}:
            free = self.nvme_free()  # the ranks on this machine share its drives
            total = (
                memory.tiers[Tier.NVME].homes_bytes
                * self.local_ranks
                // len(self.config.tiering.nvme_path)
            )
            if total > free:
                raise ConfigError(
                    f"nvme path {self.config.tiering.nvme_path[0]} has {free / 1e9:.2f} GB free "
                    "but "
                    f"the offloaded state needs {total / 1e9:.2f} GB per path; free space "
                    "or add another --nvme-path"
                )
        self.current = memory
        return memory

    def reserve_activations(
        self,
        tiers: Tiers,
        model: Any,
        batch: Any,
        placement: Placement,
        stage: int,
        vertical: bool = False,
    ) -> MemoryModel:
        """At the first training forward, take the batch's activations out of the compute
        device's budget (on the CPU device: the host budget) and refuse a batch the pools then
        cannot hold; then, horizontally, choose the units that keep their graph (`kept`) in
        what is left (vertically: `keep`, once the waiting activations are placed). Only for the
        built-in model, whose shape says what they take; other models' activations are measured
        on the first step (`keep_measured`). The memory model with them (`current` if none),
        which becomes `current`."""
        assert self.current is not None, "check() sizes the pools first"
        self.current = self._with_activations(
            tiers, model, batch, self.current, placement, stage, vertical
        )
        return self.current

    def _with_activations(
        self,
        tiers: Tiers,
        model: Any,
        batch: Any,
        memory: MemoryModel,
        placement: Placement,
        stage: int,
        vertical: bool,
    ) -> MemoryModel:
        args = getattr(model, "args", None)
        tokens = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
        builtin = (
            isinstance(args, ModelArgs)
            and isinstance(tokens, torch.Tensor)
            and tokens.dim() == 2
            and tokens.shape[1] <= args.max_seq_len
        )
        if (not builtin or vertical) and self.config.execution.recompute is Recompute.NONE:
            raise ConfigError(
                "--recompute none keeps the activations the built-in model's shape counts, in the "
                "horizontal schedule only; use --recompute auto or all for this model or schedule"
            )
        if not builtin:
            return memory
        memory = self._reserve(
            tiers,
            memory,
            placement,
            stage,
            activation_memory(
                args,
                tokens.shape[0],
                tokens.shape[1],
                self.dtype.itemsize,
                getattr(model, "loss_chunk_bytes", None),
            ),
        )
        if vertical:
            return memory  # chosen once the waiting activations have their room (`keep`)
        self.current = memory
        return self.keep(tiers, placement, stage)

    def keep(
        self, tiers: Tiers, placement: Placement, stage: int, vertical: int = 0
    ) -> MemoryModel:
        """Choose the kept units in the compute device's budget left after the current memory
        model (whose activations keep none; `vertical`: the vertical schedule's micro-batches a
        step, its waiting activations reserved already) and reserve their graphs' bytes too.
        Only for the built-in model, whose shape counts them (else `keep_measured`)."""
        act, memory = self.activations, self.current
        assert act is not None and memory is not None
        act = dataclasses.replace(act, vertical=vertical)
        tier = self._compute_tier()
        room = self._room(tiers, tier, memory)
        self.kept = choose_kept(
            self.config.execution.recompute, self.units, act, room, forward_only(self.units)
        )
        if not self.kept:
            return memory
        self.activations = with_kept(act, self.units, self.kept)
        tiers.reserve(tier, self.activations.kept_bytes)
        self.current = self.memory(placement, stage, self.activations)
        return self.current

    def keep_vertical(self, tiers: Tiers, keeping: Keeping, layout: RankLayout, batch: Any) -> None:
        """The vertical schedule's kept blocks, once its waiting activations have their room:
        the built-in model's, from its shape (another's are measured on the first step)."""
        if self.activations is not None:
            k = self.config.execution.accumulate
            self.keep(tiers, layout.placement, layout.stage, vertical=k)
            keeping.choose(self.kept, batch_tokens(batch))

    def keep_measured(self, tiers: Tiers, keeping: Keeping, vertical: int = 0) -> None:
        """After the first step of a model whose shape says nothing of its activations (once,
        while `keeping` measures): choose the kept units from the graphs its recomputes
        measured, in the compute device's budget left after the pools and the step's working
        activations (measured as well), reserve them, and keep them from the next micro-batch."""
        if not keeping.measuring:
            return
        assert self.current is not None
        tier = self._compute_tier()
        sizes = keeping.sizes(vertical)
        room = self._room(tiers, tier, self.current) - keeping.working(vertical)
        recompute = self.config.execution.recompute
        self.kept = choose_kept(recompute, self.units, None, room, forward_only(self.units), sizes)
        tiers.reserve(tier, sum(sizes[i] for i in self.kept))
        keeping.choose(self.kept, keeping.seen)

    def _compute_tier(self) -> Tier:
        return Tier.HOST if self.device.type == "cpu" else Tier.GPU

    @staticmethod
    def _room(tiers: Tiers, tier: Tier, memory: MemoryModel) -> int:
        """The compute device's budget beyond `memory`'s pools and what is reserved already."""
        budget = tiers.host_budget if tier is Tier.HOST else tiers.gpu_budget
        return budget - memory.tiers[tier].pool_bytes

    def _reserve(
        self,
        tiers: Tiers,
        memory: MemoryModel,
        placement: Placement,
        stage: int,
        act: ActivationEstimate,
    ) -> MemoryModel:
        self.activations = act
        before = _unpooled(memory)
        memory = self.memory(placement, stage, act)
        for tier, need in _unpooled(memory).items():
            if need > before.get(tier, 0):
                try:
                    tiers.reserve(tier, need - before.get(tier, 0))
                except BudgetExceededError:
                    pass  # named below, with the figures
        why = f" with batches of {act.batch_size} x {act.seq_len} tokens"
        check_pools(tiers, memory, why, self.config.streaming, self.given)
        return memory

    def nvme_free(self) -> int:
        """Free bytes on the fullest nvme path (shards stripe evenly across the paths)."""
        return free_disk_bytes(self.config.tiering.nvme_path)


def fits(mem: MemoryModel, budgets: dict[Tier, int]) -> bool:
    return all(n <= budgets[t] for t, n in mem.needs().items() if t in budgets)


def _unpooled(mem: MemoryModel) -> dict[Tier, int]:
    """What torch allocates beside the pools, per tier (on the CPU device: all of it in RAM)."""
    if mem.device == "cpu":
        return {Tier.HOST: mem.host_memory.unpooled_bytes}
    return {
        Tier.GPU: mem.tiers[Tier.GPU].unpooled_bytes,
        Tier.HOST: mem.tiers[Tier.HOST].unpooled_bytes,
    }
