"""`PlanReport`: a model on a machine, planned -- the value `tierzero.plan` returns.

Owns the plan as data, grouped into the records a reader asks about (the model, the machine,
the precision, the ZeRO stage, the recompute choice, the run whose writes are projected), and
the figures derived from it: the NVMe bytes of a step under each schedule, of an evaluation and
of a run (`wear`), what each tier holds (`homes`), one rank's share (`per_rank`) and what the
frozen base is stored as (`base`). `tierzero.planning.planreport.make_plan` builds it and
`tierzero.planning.planjson` writes it as `tierzero plan --json`'s object. It never prints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tierzero.config import TORCH_DTYPES, DType, Placement, Schedule, StateKind, Tier
from tierzero.layout.partition import Unit
from tierzero.planning import planjson
from tierzero.planning.codedbase import NF4_BYTES_PER_PARAM
from tierzero.planning.homes import describe_homes
from tierzero.planning.ledger import ActivationEstimate, waiting_activations_bytes
from tierzero.planning.peaks import format_bytes, format_count
from tierzero.planning.placement import STAGE_TEXT, Link, PlacementChoice, PlacementEstimate
from tierzero.planning.planflags import RunLength
from tierzero.planning.planrecords import (
    Machine,
    ModelShape,
    Precision,
    RecomputeChoice,
    StageChoice,
)
from tierzero.planning.statebytes import grad_dtype
from tierzero.planning.streaming import DEFAULT, Streaming
from tierzero.planning.swapplan import step_nvme_bytes
from tierzero.planning.wear import (
    DriveWear,
    checkpoint_nbytes,
    checkpoints_taken,
    step_nvme_written,
)
from tierzero.planning.workload import Workload, steps_on_gpu


@dataclass(frozen=True)
class PlanReport:
    """A model on a machine: its shape and units, the budgets, the activation estimate, every
    candidate placement's estimate and the choice; `chosen` names the streaming settings left
    to the planner, `vertical` whether the micro-batches run layer-major."""

    model: ModelShape
    machine: Machine
    precision: Precision
    workload: Workload
    activations: ActivationEstimate
    estimates: list[PlacementEstimate]
    choice: PlacementChoice
    zero: StageChoice
    chosen: tuple[str, ...]
    vertical: bool
    recompute: RecomputeChoice
    run: RunLength
    optimizer: str = ""  # where the optimizer steps, and why (`planning.stepdevice`)

    @property
    def numel(self) -> int:
        return self.model.numel

    @property
    def shape(self) -> str:
        return self.model.shape

    @property
    def dtype(self) -> DType:
        return self.precision.dtype

    @property
    def gpus(self) -> int:
        return self.machine.gpus

    @property
    def budgets(self) -> dict[Tier, int | None]:
        return self.machine.budgets

    @property
    def device(self) -> str:
        return self.machine.device

    @property
    def stage(self) -> int:
        return self.zero.stage

    @property
    def kept(self) -> ActivationEstimate | None:
        return self.recompute.kept

    @property
    def units(self) -> tuple[Unit, ...]:
        return self.workload.units

    @property
    def streaming(self) -> Streaming:
        """The piece size and prefetch depth the chosen placement is costed at (and the engine
        runs)."""
        return Streaming(self.workload.piece_numel, self.workload.prefetch_depth)

    @property
    def placement(self) -> Placement:
        """The chosen placement (the nearest miss when nothing fits: see `choice.fits`)."""
        return self.choice.placement

    def step_nvme_bytes(self) -> dict[str, int]:
        """The chosen placement's NVMe bytes (read + written) per step of `accumulate`
        micro-batches under each schedule (`swapplan.step_nvme_bytes`; params as if the host
        cache held none, as stored); vertically with the waiting activations beyond the host's
        room spilled."""
        w, p, e = self.workload, self.placement, self.choice.estimate
        one = e.moved_bytes[Link.NVME_TO_HOST] + e.moved_bytes[Link.HOST_TO_NVME]
        param = w.world_size * w.param_nbytes() if p.param is Tier.NVME else 0
        grad, spilled = self._nvme_grad_bytes(), self._spilled_bytes()
        # each schedule at its own grad dtype: one pass writes the grads once and reads them once
        h, v = (self._nvme_grad_bytes(s) for s in (Schedule.HORIZONTAL, Schedule.VERTICAL))
        horizontal = step_nvme_bytes(one + 2 * (h - grad), param, h, w.accumulate, False)
        vertical = step_nvme_bytes(one + 2 * (v - grad), param, v, w.accumulate, True, spilled)
        return {"horizontal": horizontal, "vertical": vertical}

    def evaluation(self) -> dict[str, int]:
        """NVMe bytes one evaluation reads: each unit's params once per use for the whole set
        (`engine.vertical.evaluate`), as stored; window by window, once per batch of windows."""
        units, stored = self.workload.units, self.workload.stored_param_nbytes()
        uses = sum(stored) + sum(stored[v] for u in units for v in u.uses_with)
        one = uses if self.placement.param is Tier.NVME else 0
        rows = -(-self.run.eval_tokens // self.activations.seq_len)
        batches = -(-rows // self.activations.batch_size)
        return {
            "windows": rows,
            "nvme_read_bytes": one,
            "per_window_nvme_read_bytes": batches * one,
        }

    def step_nvme_write_bytes(self) -> int:
        """The NVMe bytes written per step in the chosen placement and schedule, the write half
        of `step_nvme_bytes`: what wears the drive (`wear.step_nvme_written`)."""
        w, written = self.workload, self.choice.estimate.moved_bytes[Link.HOST_TO_NVME]
        return step_nvme_written(
            written,
            self._nvme_grad_bytes(),
            w.accumulate,
            self.vertical,
            self._spilled_bytes(),
            overlapped=w.overlap,
        )

    @property
    def wear(self) -> DriveWear:
        """What a run of `steps` writes to the drives (`tierzero.planning.wear`)."""
        run = self.run
        checkpoints = checkpoints_taken(run.steps, run.checkpoint_every)
        return DriveWear(
            run.steps,
            run.steps * self.step_nvme_write_bytes(),
            checkpoints * checkpoint_nbytes(self.workload, self.placement),
            checkpoints,
            run.drive_tbw,
        )

    def homes(self) -> dict[str, Any]:
        """What each tier holds under the chosen placement, per state kind in its stored dtype."""
        w, p, pr = self.workload, self.placement, self.precision
        grads = f"grads {pr.grad_dtype.value}: {pr.grad_reason}"
        text = f"{describe_homes(w, p, pr.dtype)} ({grads})"
        return {"kinds": {k.value: p.home(k).value for k in StateKind}, "text": text}

    def base(self) -> dict[str, Any]:
        """What the params are stored as, every rank's: with a coded base, how many are in NF4
        and what the whole takes against the compute dtype."""
        w = self.workload
        quantized = 0 if w.coded is None else w.coded.quantized_numel
        stored = w.param_nbytes() * w.world_size
        plain = dataclasses.replace(w, coded=None).param_nbytes() * w.world_size
        dtype = self.precision.dtype.value
        text = (
            f"nf4: {format_count(quantized)} params, the blocks' frozen linear weights, in 4 bits "
            f"({NF4_BYTES_PER_PARAM:g} B each with its block's absmax); the embeddings, norms, "
            f"head and adapters in {dtype}: {format_bytes(stored)} stored "
            f"({stored / max(1, self.numel):.2f} B/param), {format_bytes(plain)} in {dtype}"
            if w.coded is not None
            else f"{dtype}, as computed"
        )
        return {
            "quantize_base": "none" if w.coded is None else "nf4",
            "quantized_params": quantized,
            "stored_bytes": stored,
            "compute_dtype_bytes": plain,
            "bytes_per_param": stored / max(1, self.numel),
            "text": text,
        }

    def per_rank(self) -> dict[str, Any]:
        """One rank's share of the chosen placement: what its pools and `tierzero train` budgets
        hold (train's default host budget is the machine's, split evenly across its ranks)."""
        mine = self.choice.estimate.memory.per_rank()
        host, gpus = self.budgets[Tier.HOST], self.gpus
        return {
            "ranks": gpus,
            "peak_bytes": {t.value: n for t, n in mine.needs().items()},
            "pool_bytes": {t.value: mine.tiers[t].pool_bytes for t in (Tier.GPU, Tier.HOST)},
            "host_budget_bytes": None if host is None else host // gpus,
            "breakdown": mine.breakdown(),
        }

    def _nvme_grad_bytes(self, schedule: Schedule | None = None) -> int:
        """Every rank's NVMe-homed grads: what each further horizontal micro-batch reads and
        writes (in the grad dtype planned, or the one `schedule` would store them in)."""
        w = self.workload
        itemsize = (
            w.nbytes(StateKind.GRAD)
            if schedule is None
            else TORCH_DTYPES[grad_dtype(self.dtype, w.accumulate, schedule)].itemsize
        )
        on_nvme = self.placement.grad is Tier.NVME
        return w.world_size * w.state_shard_numel * itemsize if on_nvme else 0

    def _spilled_bytes(self) -> int:
        """The vertical schedule's waiting activations beyond the host's room (spilled to
        NVMe)."""
        w, e, args = self.workload, self.choice.estimate, self.model.args
        waiting = self.gpus * waiting_activations_bytes(
            args.n_layers,
            args.dim,
            args.vocab_size,
            args.tie_embeddings,
            self.activations.batch_size * self.activations.seq_len,
            w.accumulate,
            w.compute_itemsize,
        )
        host = self.budgets[Tier.HOST]
        return 0 if host is None else max(0, waiting - max(0, host - e.memory.needs()[Tier.HOST]))

    def as_dict(self) -> dict[str, Any]:
        """The JSON object `tierzero plan --json` prints, in the order the text report prints
        it (`tierzero.planning.planjson` writes each record's section)."""
        streaming, estimate = self.streaming, self.choice.estimate
        return {
            "model": planjson.model(self.model, self.workload),
            "machine": planjson.machine(self.machine),
            "dtype": self.dtype.value,
            "dtype_source": self.precision.source,
            "drive_wear": self.wear.as_dict(),
            "state_formats": planjson.state_formats(self.precision),
            "homes": self.homes(),
            "base": self.base(),
            "ledger": planjson.ledger_rows(self.model, self.precision, self.gpus),
            "compact_ledger": planjson.compact_rows(self.precision),
            "activations": planjson.activations(self.activations),
            "placements": [
                {**e.as_dict(), "fits": not e.overflow_bytes(self.budgets)} for e in self.estimates
            ],
            "verdict": {**self.choice.as_dict(), "breakdown": estimate.memory.breakdown()},
            "per_rank": self.per_rank(),
            "optimizer": {
                "device": "gpu" if steps_on_gpu(self.placement) else "cpu",
                "why": self.optimizer,
            },
            "stage": {
                "stage": self.zero.stage,
                "reason": self.zero.reason,
                "text": STAGE_TEXT[self.zero.stage],
            },
            "evaluation": self.evaluation(),
            "schedule": {
                "schedule": "vertical" if self.vertical else "horizontal",
                "accumulate": self.workload.accumulate,
                "nvme_bytes_per_step": self.step_nvme_bytes(),
            },
            "recompute": planjson.recompute(self.recompute, self.activations),
            "streaming": {
                "piece_numel": streaming.piece_numel,
                "prefetch_depth": streaming.prefetch_depth,
                "default": streaming == DEFAULT,
                "chosen": list(self.chosen),
            },
        }
