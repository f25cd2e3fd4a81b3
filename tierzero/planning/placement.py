"""The placement planner: which tier is each state kind's home, what that costs, and which fits.

Owns the candidate placements, the bytes each moves per step, the step-time model from a
`tierzero bench` profile, and the choice `--offload auto` makes. What each placement holds in
each tier at peak is the one memory model's (`tierzero.planning.memory_model`), which the
engine uses too.
Plans are data: everything here is arithmetic on unit sizes and budgets. The only I/O is
`load_profile` reading a JSON file; probing the machine for budgets is the caller's job.

Accounting conventions (`world_size` ranks on one machine, one micro-batch per step; ZeRO
stage 3 unless a workload says otherwise):

- gpu bytes are per GPU; host and nvme bytes are per machine (every rank's shards).
- traffic is per optimizer step, per link and direction; `host->gpu`/`gpu->host` are per GPU
  (each GPU has its own link), `nvme->host`/`host->nvme` are per machine (the drives are shared).
- a state whose home is not the tier it is used on moves hop by hop (nvme -> host -> gpu).
  The engine's host cache of recently used shards can only lower these numbers.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierzero.config import OPTIMIZER_KINDS, Placement, StateKind, Tier
from tierzero.errors import ConfigError
from tierzero.planning.ledger import GB
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.peaks import MemoryModel
from tierzero.planning.workload import Workload, steps_on_gpu

FLOPS_PER_PARAM_TOKEN = 8  # 2 forward + 4 backward + 2 for the checkpointed forward recomputed


class Link(str, enum.Enum):
    NVME_TO_HOST = "nvme->host"
    HOST_TO_NVME = "host->nvme"
    HOST_TO_GPU = "host->gpu"
    GPU_TO_HOST = "gpu->host"


_TIER_ORDER = (Tier.GPU, Tier.HOST, Tier.NVME)
_NVME_LINKS = (Link.NVME_TO_HOST, Link.HOST_TO_NVME)
_PCIE_LINKS = (Link.HOST_TO_GPU, Link.GPU_TO_HOST)


def candidate_placements(coded: bool = False) -> list[Placement]:
    """All-gpu, then stage 3 with params on gpu/host/nvme, grads on host/nvme and the optimizer
    states (master, exp_avg, exp_avg_sq, always together) on host/nvme: fastest tiers first.
    A `coded` (NF4) base is stored off the GPU and decoded there per fetch: params host/nvme."""
    offloaded = [
        Placement(param, grad, opt, opt, opt)
        for param, grad, opt in itertools.product(_TIER_ORDER, _TIER_ORDER[1:], _TIER_ORDER[1:])
    ]
    every = [Placement()] + offloaded
    return [p for p in every if p.param is not Tier.GPU] if coded else every


@dataclass(frozen=True)
class Profile:
    """Measured speeds from `tierzero bench --profile-out`. Bandwidths in GB/s (1e9 bytes/s)."""

    nvme_read_gbps: float
    nvme_write_gbps: float
    adam_params_per_s: float
    fp32_tflops: float
    bf16_tflops: float
    h2d_pinned_gbps: float | None  # None: no GPU when benched; the gpu tier is host memory


def load_profile(path: str | Path) -> Profile:
    """Read a bench profile; a missing or malformed file is a ConfigError naming the key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"profile '{p}' does not exist; write one with `tierzero bench --profile-out {p}`"
        )
    try:
        d = json.loads(p.read_text())
        h2d = d["h2d"]
        profile = Profile(
            nvme_read_gbps=float(d["nvme"]["read_gbps"]),
            nvme_write_gbps=float(d["nvme"]["write_gbps"]),
            adam_params_per_s=float(d["adam"]["params_per_s"]),
            fp32_tflops=float(d["compute"]["fp32_tflops"]),
            bf16_tflops=float(d["compute"]["bf16_tflops"]),
            h2d_pinned_gbps=None if h2d is None else float(h2d["pinned_gbps"]),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"profile '{p}' is malformed ({type(e).__name__}: {e}); "
            "re-run `tierzero bench --profile-out` to rewrite it"
        ) from None
    speeds = [v for v in vars(profile).values() if v is not None]
    if not all(math.isfinite(v) and v > 0 for v in speeds):
        raise ConfigError(
            f"profile '{p}' has a speed that is not a positive number; re-run `tierzero bench`"
        )
    return profile


@dataclass(frozen=True)
class PlacementEstimate:
    """One placement's cost for a workload: peak bytes per tier (`resident_bytes`: what each
    tier's budget must hold, from `memory`), bytes moved per step per link, and the predicted
    step time when a profile was given."""

    placement: Placement
    resident_bytes: dict[Tier, int]
    moved_bytes: dict[Link, int]
    predicted_step_s: float | None
    memory: MemoryModel | None = None

    def overflow_bytes(self, budgets: dict[Tier, int | None]) -> dict[Tier, int]:
        """Bytes over budget, for each tier that is over (None = unbounded)."""
        over = {t: self.resident_bytes[t] - b for t, b in budgets.items() if b is not None}
        return {t: n for t, n in over.items() if n > 0}

    def as_dict(self) -> dict[str, Any]:
        return {
            "placement": {k.value: self.placement.home(k).value for k in StateKind},
            "resident_bytes": {t.value: n for t, n in self.resident_bytes.items()},
            "moved_bytes": {link.value: n for link, n in self.moved_bytes.items()},
            "predicted_step_s": self.predicted_step_s,
            "memory": None if self.memory is None else self.memory.as_dict(),
        }


def estimate(
    placement: Placement, work: Workload, profile: Profile | None = None
) -> PlacementEstimate:
    """Cost `placement` for `work`; see the module docstring for the conventions. What each
    tier holds at peak is the one memory model's (`memory_model.peak_memory`)."""
    fwd_bwd, optimizer = _traffic(placement, work)
    moved = {link: fwd_bwd[link] + optimizer[link] for link in Link}
    step_s = None if profile is None else _step_time(placement, work, profile, fwd_bwd, optimizer)
    memory = peak_memory(work, placement)
    return PlacementEstimate(placement, memory.needs(), moved, step_s, memory)


def _optimizer_tier(p: Placement) -> Tier:
    return Tier.GPU if steps_on_gpu(p) else Tier.HOST


def _hops(src: Tier, dst: Tier) -> list[Link]:
    i, j = _TIER_ORDER.index(src), _TIER_ORDER.index(dst)
    down = {(0, 1): Link.GPU_TO_HOST, (1, 2): Link.HOST_TO_NVME}
    up = {(2, 1): Link.NVME_TO_HOST, (1, 0): Link.HOST_TO_GPU}
    if i < j:
        return [down[(k, k + 1)] for k in range(i, j)]
    return [up[(k, k - 1)] for k in range(i, j, -1)]


def _traffic(p: Placement, w: Workload) -> tuple[dict[Link, int], dict[Link, int]]:
    """Bytes per link in the forward/backward phase and in the optimizer phase. Params move
    whole; grads, optimizer states and the stepped params only for trainable parameters, each
    state in its stored format (`Workload.formats`). Where the param is the master (one bf16
    tensor on one tier) the master's write is the new param's."""

    def move(moved: dict[Link, int], kind: StateKind, src: Tier, dst: Tier, times: int = 1) -> None:
        nbytes = (
            w.param_nbytes()  # as stored: a coded base's pieces move coded
            if kind is StateKind.PARAM and moved is fwd_bwd
            else w.state_nbytes(kind)
        )
        for link in _hops(src, dst):
            ranks = w.world_size if link in _NVME_LINKS else 1
            moved[link] += times * ranks * nbytes

    fwd_bwd = dict.fromkeys(Link, 0)
    move(
        fwd_bwd, StateKind.PARAM, p.param, Tier.GPU, times=2
    )  # gathered in forward and again in backward
    move(fwd_bwd, StateKind.GRAD, Tier.GPU, p.grad)
    optimizer = dict.fromkeys(Link, 0)
    where = _optimizer_tier(p)
    move(optimizer, StateKind.GRAD, p.grad, where)
    for kind in OPTIMIZER_KINDS:  # read, step, write back
        move(optimizer, kind, p.home(kind), where)
        move(optimizer, kind, where, p.home(kind))
    if not w.one_weight(p):
        move(optimizer, StateKind.PARAM, where, p.param)  # the new compute-dtype param
    if (
        w.replicated and p.param is Tier.NVME
    ):  # stage 1/2: each rank's new range read back, the others' written
        param = w.nbytes(StateKind.PARAM) * w.world_size
        optimizer[Link.NVME_TO_HOST] += w.shard_numel * param
        optimizer[Link.HOST_TO_NVME] += (w.numel - w.shard_numel) * param
    return fwd_bwd, optimizer


def choose_stage(
    fits: Callable[[int], bool], world_size: int, accumulate: int, forced: int | None = None
) -> tuple[int, str]:
    """The ZeRO stage and why: `forced` when given; with one rank 3 (the stages are one run);
    else the least communication whose state `fits` the budgets -- stage 1 when `accumulate` > 1
    (no reduction per micro-batch), then 2 (no all-gather per unit use) -- or stage 3."""
    if forced is not None:
        return forced, "forced"
    if world_size == 1:
        return 3, "one rank"
    for stage in (1, 2) if accumulate > 1 else (2,):
        if fits(stage):
            return stage, "replicated params fit the budgets"
    return 3, "replicated params do not fit the budgets"


STAGE_TEXT = {
    1: "params and grads replicated, optimizer states partitioned",
    2: "params replicated, grads and optimizer states partitioned",
    3: "params, grads and optimizer states partitioned",
}


def _step_time(
    p: Placement, w: Workload, prof: Profile, fwd_bwd: dict[Link, int], optimizer: dict[Link, int]
) -> float:
    """max(compute, nvme I/O, PCIe I/O) for forward+backward, plus max(Adam, its own I/O).

    Compute is 8 * params * tokens FLOPs (6 for a step, 2 for the checkpointed recompute).
    NVMe reads and writes share the drives, so their times add. Without a GPU in the profile
    the gpu tier is host memory and PCIe copies cost nothing. CPU Adam steps every rank's
    shard on the machine's one CPU; GPU Adam (all-gpu) is taken as free next to the I/O.
    """
    tflops = prof.fp32_tflops if w.compute_itemsize == 4 else prof.bf16_tflops
    compute_s = FLOPS_PER_PARAM_TOKEN * w.numel * w.tokens_per_step / (tflops * 1e12)

    def io_s(moved: dict[Link, int]) -> float:
        nvme = moved[Link.NVME_TO_HOST] / (prof.nvme_read_gbps * GB) + moved[Link.HOST_TO_NVME] / (
            prof.nvme_write_gbps * GB
        )
        pcie = (
            0.0
            if prof.h2d_pinned_gbps is None
            else sum(moved[k] for k in _PCIE_LINKS) / (prof.h2d_pinned_gbps * GB)
        )
        return max(nvme, pcie)

    adam_s = 0.0
    if _optimizer_tier(p) is Tier.HOST:
        adam_s = w.state_shard_numel * w.world_size / prof.adam_params_per_s
    return max(compute_s, io_s(fwd_bwd)) + max(adam_s, io_s(optimizer))


@dataclass(frozen=True)
class PlacementChoice:
    """The planner's answer: the best placement that fits, or the nearest miss and what it lacks.

    `fits` False means no candidate fits every budget; `placement` is then the nearest miss
    (least missing bytes in total) and `shortfall_bytes` says which tier lacks how many bytes.
    """

    estimate: PlacementEstimate
    fits: bool
    shortfall_bytes: dict[Tier, int] = field(default_factory=dict)

    @property
    def placement(self) -> Placement:
        return self.estimate.placement

    @property
    def resident_bytes(self) -> dict[Tier, int]:
        return self.estimate.resident_bytes

    @property
    def moved_bytes(self) -> dict[Link, int]:
        return self.estimate.moved_bytes

    @property
    def predicted_step_s(self) -> float | None:
        return self.estimate.predicted_step_s

    @property
    def shortfall(self) -> str | None:
        """One sentence naming each short tier, the missing bytes and a fix; None if it fits."""
        if self.fits:
            return None
        lacks = ", ".join(
            f"{n / GB:.2f} GB more {tier.value} memory"
            if tier is not Tier.NVME
            else f"{n / GB:.2f} GB more free nvme space"
            for tier, n in self.shortfall_bytes.items()
        )
        fixes = {
            Tier.GPU: "a smaller batch or sequence, a lower prefetch depth or more GPUs",
            Tier.HOST: "a larger host budget",
            Tier.NVME: "more free space on the nvme path(s)",
        }
        return (
            f"no placement fits; the nearest ({self.placement.describe()}) needs {lacks}; "
            f"try {' and '.join(fixes[t] for t in self.shortfall_bytes)}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.estimate.as_dict(),
            "fits": self.fits,
            "shortfall": self.shortfall,
            "shortfall_bytes": {t.value: n for t, n in self.shortfall_bytes.items()},
        }


def choose(
    estimates: Sequence[PlacementEstimate], budgets: dict[Tier, int | None]
) -> PlacementChoice:
    """The fitting estimate with the least predicted step time, or without a profile the least
    NVMe traffic, then the least PCIe traffic (NVMe is the slowest link by about 10x); ties go
    to the earlier candidate. If none fits, the one missing the fewest bytes in total."""
    fitting = [e for e in estimates if not e.overflow_bytes(budgets)]
    if fitting:
        return PlacementChoice(min(fitting, key=_cost), fits=True)
    nearest = min(estimates, key=lambda e: sum(e.overflow_bytes(budgets).values()))
    return PlacementChoice(nearest, fits=False, shortfall_bytes=nearest.overflow_bytes(budgets))


def _cost(e: PlacementEstimate) -> tuple[float, ...]:
    if e.predicted_step_s is not None:
        return (e.predicted_step_s,)
    return (sum(e.moved_bytes[k] for k in _NVME_LINKS), sum(e.moved_bytes[k] for k in _PCIE_LINKS))


def choose_placement(
    work: Workload,
    *,
    gpu_budget: int | None,
    host_budget: int | None,
    nvme_free: int | None,
    profile: Profile | None = None,
    candidates: Sequence[Placement] | None = None,
) -> PlacementChoice:
    """The placement `--offload auto` uses for `work`: it fits every budget with the least
    predicted step time (with a `profile`) or the least traffic (without).

    Budgets are bytes: `gpu_budget` per GPU, `host_budget` and `nvme_free` per machine; None =
    unbounded. What fits is the memory model's (`tierzero.planning.memory_model`): `work`'s
    activations are charged to the compute device; on the CPU device the host budget holds the
    gpu tier too. `candidates` (default: every candidate placement) lets a caller pre-filter,
    as the engine does.
    """
    budgets = {Tier.GPU: gpu_budget, Tier.HOST: host_budget, Tier.NVME: nvme_free}
    placements = candidate_placements() if candidates is None else candidates
    return choose([estimate(p, work, profile) for p in placements], budgets)
