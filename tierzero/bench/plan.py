"""The GPU benchmark's plan, decided before anything runs: which placements the machine's
budgets admit (the planner's verdict), which preset, micro-batch, accumulation and number of
steps each placement gets inside its share of the time budget, and the bound of a step.

The bound of a step is max(compute = 8 N tokens / peak, H2D bytes / H2D peak, D2H bytes / D2H
peak, NVMe read / read peak + NVMe write / write peak, N / CPU AdamW rate): per-unit
checkpointing recomputes each forward once in backward (8 N flops per token, not 6 N), and
NVMe reads and writes share the drive. Nothing here needs a GPU, a disk or a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tierzero.config import Placement, Schedule, StateKind, Tier
from tierzero.models import ModelArgs
from tierzero.models.llama import loss_chunk_bytes
from tierzero.models.presets import PRESETS
from tierzero.planning.ledger import activation_memory, state_nbytes
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.peaks import MemoryModel, format_bytes
from tierzero.planning.workload import Workload

PLACEMENTS = {
    "host": Placement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST),
    "nvme": Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME),
}
COMPUTE_ITEMSIZE = 2  # bf16
PREFETCH_DEPTH = 2
# A first run of code that has not yet run on a GPU: a step is planned at this many times its
# bound, so the steps it sizes still fit when the step is far from the bound.
STEP_SLACK = 3.0
# Host placements materialise the state in RAM at open (random init, then the fp32 copies):
# a rate that a CPU of this class beats, so open is not under-planned.
HOST_INIT_BYTES_PER_S = 1e9
OPEN_SLACK = 2.0  # NVMe placements write every state at open (and delete it at close)
# fp32 grads: 18
STATE_BYTES_PER_PARAM = sum(state_nbytes(k, COMPUTE_ITEMSIZE, 4) for k in StateKind)


@dataclass(frozen=True)
class Machine:
    """What the run may use now: the GPU's free memory, a share of the free RAM, the free disk
    of the work dir, and whether that disk takes direct I/O."""

    gpu_bytes: int
    host_bytes: int
    disk_bytes: int
    direct_io: bool = True


@dataclass(frozen=True)
class Rates:
    """Peaks measured in the same run (or nominal ones for a dry run); 0: not measured."""

    bf16_tflops: float
    h2d_gbps: float
    d2h_gbps: float
    nvme_read_gbps: float
    nvme_write_gbps: float
    adam_params_per_s: float


# An H200-class machine's rough figures, only for the dry run's arithmetic (never reported as
# measured).
NOMINAL = Rates(
    bf16_tflops=700.0,
    h2d_gbps=50.0,
    d2h_gbps=50.0,
    nvme_read_gbps=6.0,
    nvme_write_gbps=4.0,
    adam_params_per_s=1.5e9,
)
NOMINAL_H200 = Machine(gpu_bytes=139 << 30, host_bytes=int(128e9 * 0.8), disk_bytes=int(64e9 * 0.9))


@dataclass(frozen=True)
class Verdict:
    """The planner's verdict on one placement at one size: what each tier needs and may use."""

    placement: str
    preset: str
    needs: dict[str, int]
    budgets: dict[str, int]
    refused: str | None = None  # why, in one sentence; None: it fits

    def line(self) -> str:
        tiers = ", ".join(
            f"{t} {format_bytes(self.needs[t])} of {format_bytes(self.budgets[t])}"
            for t in self.needs
        )
        return f"{self.placement} ({self.preset}): {self.refused or 'fits'} [{tiers}]"


@dataclass(frozen=True)
class StagePlan:
    """One placement's share of the time budget and what fits in it."""

    placement: str
    preset: str
    micro_batch: int
    seq_len: int
    accumulate: int
    steps: int  # timed, after one warm-up; one more is traced
    step_bound_s: float
    bound_by: str
    open_s: float  # planned: materialising (NVMe: writing) the state at open
    budget_s: float

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len * self.accumulate

    @property
    def planned_step_s(self) -> float:
        return STEP_SLACK * self.step_bound_s

    @property
    def planned_s(self) -> float:
        """open + warm-up + timed steps + the traced step (each at the planned step time)."""
        return self.open_s + (self.steps + 2) * self.planned_step_s

    def line(self) -> str:
        return (
            f"{self.placement}: {self.preset}, "
            f"{self.micro_batch} x {self.seq_len} x {self.accumulate} tokens, "
            f"{self.steps} timed steps; bound {self.step_bound_s:.2f} s ({self.bound_by}), planned "
            f"{self.planned_s:.0f} s of its {self.budget_s:.0f} s"
        )


def memory(args: ModelArgs, placement: Placement, micro_batch: int, seq_len: int) -> MemoryModel:
    """The engine's own memory model for this preset, placement and micro-batch."""
    return peak_memory(
        Workload.from_preset(
            args,
            COMPUTE_ITEMSIZE,
            device="cuda",
            prefetch_depth=PREFETCH_DEPTH,
            overlap=True,
            activations=activation_memory(
                args, micro_batch, seq_len, COMPUTE_ITEMSIZE, loss_chunk_bytes(args.vocab_size)
            ),
        ),
        placement,
    )


def verdict(
    name: str, preset: str, machine: Machine, micro_batch: int = 1, seq_len: int = 2048
) -> Verdict:
    """Whether placement `name` of `preset` fits the machine's budgets now, and if not, why."""
    args = PRESETS[preset]
    needs = memory(args, PLACEMENTS[name], micro_batch, min(seq_len, args.max_seq_len)).needs()
    budgets = {
        Tier.GPU: machine.gpu_bytes,
        Tier.HOST: machine.host_bytes,
        Tier.NVME: machine.disk_bytes,
    }
    over = [t for t in budgets if needs[t] > budgets[t]]
    refused = None
    if over:
        t = over[0]
        refused = (
            f"refused: {t.value} needs {format_bytes(needs[t])} but {format_bytes(budgets[t])} "
            f"is free; free some {t.value} memory or disk, or pick a smaller --preset"
        )
    elif name == "nvme" and not machine.direct_io:
        refused = (
            "refused: the work dir's filesystem refuses direct I/O (O_DIRECT); "
            "pass --work-dir on a local SSD"
        )
    return Verdict(
        name,
        preset,
        {t.value: needs[t] for t in budgets},
        {t.value: b for t, b in budgets.items()},
        refused,
    )


def fits(mem: MemoryModel, machine: Machine) -> bool:
    needs = mem.needs()
    return (
        needs[Tier.GPU] <= machine.gpu_bytes
        and needs[Tier.HOST] <= machine.host_bytes
        and needs[Tier.NVME] <= machine.disk_bytes
    )


def pick_preset(machine: Machine, seq_len: int) -> str | None:
    """The largest preset (by parameters) that fits in *both* placements at micro-batch 1."""
    for name in sorted(PRESETS, key=lambda n: PRESETS[n].param_count(), reverse=True):
        args = PRESETS[name]
        if all(
            fits(memory(args, p, 1, min(seq_len, args.max_seq_len)), machine)
            for p in PLACEMENTS.values()
        ):
            return name
    return None


def pick_micro_batch(
    args: ModelArgs,
    machine: Machine,
    seq_len: int,
    largest: int = 64,
    placements: tuple[str, ...] = tuple(PLACEMENTS),
) -> int:
    """The largest power-of-two micro-batch up to `largest` whose activations fit (at least 1)."""
    best = 1
    while best * 2 <= largest and all(
        fits(memory(args, PLACEMENTS[p], best * 2, seq_len), machine) for p in placements
    ):
        best *= 2
    return best


def schedule_for(accumulate: int) -> Schedule:
    """The benchmark accumulates layer-major: horizontal would move every param again per
    micro-batch."""
    return Schedule.VERTICAL if accumulate > 1 else Schedule.HORIZONTAL


def step_traffic(
    args: ModelArgs,
    placement: str,
    accumulate: int = 1,
    schedule: Schedule = Schedule.HORIZONTAL,
    micro_tokens: int = 0,
) -> dict[str, int]:
    """Bytes one step of `accumulate` micro-batches moves, by link, with overlap_step (the last
    micro-batch's grads go straight to the optimizer). Horizontal: every micro-batch fetches
    every param twice (forward, recompute in backward) and sends its fp32 grads to the host;
    each after the first brings the earlier micro-batches' sums back to add them on the GPU.
    Vertical: each unit's params come twice per step and its grad, summed on the GPU, goes
    once; each micro-batch's input to every block (`micro_tokens` x dim) waits in host memory
    between the passes (out and back). With nvme homes the params are read twice per pass (an
    upper bound: the host's param cache saves some reads) and written once, the optimizer reads
    and writes master and both moments, and horizontally the grad sums of all but the last
    micro-batch are written, and of all but the first read."""
    n = args.param_count()
    passes, sums = (1, 0) if schedule == Schedule.VERTICAL else (accumulate, accumulate - 1)
    params = 2 * n * COMPUTE_ITEMSIZE
    waiting = (
        accumulate * args.n_layers * micro_tokens * args.dim * COMPUTE_ITEMSIZE
        if schedule == Schedule.VERTICAL
        else 0
    )
    out = {
        "h2d": passes * params + sums * n * 4 + waiting,
        "d2h": passes * n * 4 + waiting,
        "nvme_read": 0,
        "nvme_write": 0,
    }
    if placement == "nvme":
        out["nvme_read"] = passes * params + 3 * n * 4 + sums * n * 4
        out["nvme_write"] = n * COMPUTE_ITEMSIZE + 3 * n * 4 + sums * n * 4
    return out


def _seconds(nbytes: float, gbps: float) -> float:
    """Nothing to move takes no time, measured rate or not; something over an unmeasured link
    never ends."""
    return 0.0 if nbytes == 0 else nbytes / (gbps * 1e9) if gbps > 0 else math.inf


def bound(n_params: int, tokens: int, traffic: dict[str, int], rates: Rates) -> dict[str, Any]:
    """Seconds each resource needs for one step, and the bound: the largest of them.

    compute counts the recompute (8 N flops per token). NVMe reads and writes share the drive,
    so their times add."""
    terms = {
        "compute": _seconds(8 * n_params * tokens, rates.bf16_tflops * 1e3),
        "h2d": _seconds(traffic["h2d"], rates.h2d_gbps),
        "d2h": _seconds(traffic["d2h"], rates.d2h_gbps),
        "nvme": _seconds(traffic["nvme_read"], rates.nvme_read_gbps)
        + _seconds(traffic["nvme_write"], rates.nvme_write_gbps),
        "cpu_adam": n_params / rates.adam_params_per_s,
    }
    limit = max(terms, key=terms.get)
    return {**terms, "bound_s": terms[limit], "bound_by": limit}


def pick_accumulation(
    args: ModelArgs, placement: str, micro_tokens: int, rates: Rates, most: int
) -> int:
    """Micro-batches per step: the fewest (at most `most`) whose bound per token is within 10%
    of the bound per token at `most`. Layer-major accumulation amortises what a step moves once
    (params twice, grads, the optimizer's states, CPU AdamW); the waiting activations grow with
    every micro-batch as compute does, so where they outrun compute only a larger micro-batch
    helps."""
    n = args.param_count()

    def per_token(accumulate: int) -> float:
        tokens = micro_tokens * accumulate
        traffic = step_traffic(args, placement, accumulate, schedule_for(accumulate), micro_tokens)
        return bound(n, tokens, traffic, rates)["bound_s"] / tokens

    limit = per_token(most)
    return next(a for a in range(1, most + 1) if per_token(a) <= 1.1 * limit)


def open_seconds(args: ModelArgs, placement: str, rates: Rates) -> float:
    """Planned seconds to open (and close) a placement: every state is written once."""
    nbytes = args.param_count() * STATE_BYTES_PER_PARAM
    if placement == "nvme":
        return OPEN_SLACK * _seconds(nbytes, rates.nvme_write_gbps)
    return nbytes / HOST_INIT_BYTES_PER_S


def size_stage(
    name: str,
    machine: Machine,
    rates: Rates,
    budget_s: float,
    presets: list[str],
    seq_len: int,
    largest_micro: int,
    most_accumulate: int,
    max_steps: int,
) -> StagePlan | Verdict:
    """The largest of `presets` (and its steps, at most `max_steps`) whose planned time -- open,
    a warm-up, at least one timed step and the traced one -- fits `budget_s` and whose state
    fits the machine; else the last refusal (the smallest preset's verdict, or its time)."""
    refusal: Verdict | None = None
    for preset in sorted(presets, key=lambda p: PRESETS[p].param_count(), reverse=True):
        args = PRESETS[preset]
        seq = min(seq_len, args.max_seq_len)
        v = verdict(name, preset, machine, 1, seq)
        if v.refused:
            refusal = v
            continue
        micro = pick_micro_batch(args, machine, seq, largest_micro, (name,))
        for acc in sorted(
            {pick_accumulation(args, name, micro * seq, rates, most_accumulate), 1}, reverse=True
        ):
            b = bound(
                args.param_count(),
                micro * seq * acc,
                step_traffic(args, name, acc, schedule_for(acc), micro * seq),
                rates,
            )
            stage = StagePlan(
                name,
                preset,
                micro,
                seq,
                acc,
                1,
                b["bound_s"],
                b["bound_by"],
                open_seconds(args, name, rates),
                budget_s,
            )
            if stage.planned_s <= budget_s:
                room = int((budget_s - stage.open_s) / stage.planned_step_s) - 2
                return StagePlan(**{**stage.__dict__, "steps": max(1, min(max_steps, room))})
        refusal = Verdict(
            name,
            preset,
            v.needs,
            v.budgets,
            f"refused: {preset} would take {stage.planned_s:.0f} s planned, "
            f"over its {budget_s:.0f} s; raise --minutes or pick a smaller --preset",
        )
    assert refusal is not None, "no presets to size"
    return refusal


def share_time(total_s: float, placements: list[str]) -> dict[str, float]:
    """Each placement's share of the training time: NVMe, which writes every state at open and
    moves the most per step, gets 60% when both run."""
    weights = {"host": 2.0, "nvme": 3.0}
    whole = sum(weights[p] for p in placements)
    return {p: total_s * weights[p] / whole for p in placements}


def report_row(
    name: str,
    args: ModelArgs,
    tokens: int,
    step_s: float,
    stats: dict[str, float],
    rates: Rates,
    registrations_per_step: float,
) -> dict[str, Any]:
    """One placement's figures from its median step time and one step's engine counters."""
    n = args.param_count()
    traffic = {
        "h2d": int(stats.get("bytes_host->gpu", 0)),
        "d2h": int(stats.get("bytes_gpu->host", 0)),
        "nvme_read": int(stats.get("bytes_nvme->host", 0)),
        "nvme_write": int(stats.get("bytes_host->nvme", 0)),
    }
    b = bound(n, tokens, traffic, rates)
    model_tflops = 6 * n * tokens / step_s / 1e12
    hw_tflops = 8 * n * tokens / step_s / 1e12
    return {
        "placement": name,
        "params": n,
        "tokens_per_step": tokens,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "model_tflops": model_tflops,
        "hw_tflops": hw_tflops,
        "bf16_peak_tflops": rates.bf16_tflops,
        "model_ratio": model_tflops / rates.bf16_tflops,
        "hw_ratio": hw_tflops / rates.bf16_tflops,
        "h2d_gbps": traffic["h2d"] / step_s / 1e9,
        "h2d_peak_gbps": rates.h2d_gbps,
        "d2h_gbps": traffic["d2h"] / step_s / 1e9,
        "d2h_peak_gbps": rates.d2h_gbps,
        "nvme_gbps": (traffic["nvme_read"] + traffic["nvme_write"]) / step_s / 1e9,
        "io_wait_share": stats.get("io_wait_s", 0.0) / step_s,
        "bound_s": b["bound_s"],
        "bound_by": b["bound_by"],
        "step_over_bound": step_s / b["bound_s"],
        "terms_s": {k: b[k] for k in ("compute", "h2d", "d2h", "nvme", "cpu_adam")},
        "host_registrations_per_step": registrations_per_step,
    }


def table_lines(rows: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The report as (figure, value per placement) rows: placements side by side."""

    def each(fmt: str) -> tuple[str, ...]:
        return tuple(fmt.format(**r) for r in rows)

    return [
        ("placement", *each("{placement} ({preset})")),
        ("tokens / step", *each("{micro_batch} x {seq_len} x {accumulate} = {tokens_per_step}")),
        ("step", *each("{step_s:.2f} s")),
        ("tokens / s", *each("{tokens_per_s:,.0f}")),
        (
            "model TFLOPS (6N)",
            *each("{model_tflops:.1f} = {model_ratio:.0%} of bf16 peak {bf16_peak_tflops:.0f}"),
        ),
        ("with recompute (8N)", *each("{hw_tflops:.1f} = {hw_ratio:.0%} of peak")),
        ("H2D GB/s (peak)", *each("{h2d_gbps:.1f} ({h2d_peak_gbps:.1f})")),
        ("D2H GB/s (peak)", *each("{d2h_gbps:.1f} ({d2h_peak_gbps:.1f})")),
        ("NVMe GB/s", *each("{nvme_gbps:.2f}")),
        ("I/O wait share", *each("{io_wait_share:.0%}")),
        ("bound", *each("{bound_s:.2f} s ({bound_by})")),
        ("step / bound", *each("{step_over_bound:.2f}x")),
        ("pinning calls / step", *each("{host_registrations_per_step:.1f}")),
    ]
