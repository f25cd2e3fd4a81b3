"""The bytes of each state kind in the format it is stored in: fp32, or compact.

Owns `StateBytes`, the (Adam moments, master) choice a run makes (`Config.optimizer_state`,
`Config.master`) as the planner counts it: params and grads in their dtypes, the master and
moments as the engine stores them (`tierzero.compact.formats.StateFormats`, the one place that
knows a stored piece's size: int8 adds one fp32 scale per `STATE_BLOCK` values, blocks counted
per run of elements since pieces and units start on a block). With bf16 compute and a bf16
master the param *is* the master (one tensor): where both are homed on one tier the param
takes no bytes of its own there. The ledger, the memory model and the placement planner count
with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierzero.compact.formats import StateFormats
from tierzero.config import STATE_BLOCK, DType, Schedule, StateFormat, StateKind

FP32_NBYTES = 4


def grad_dtype(compute: DType, accumulate: int, schedule: Schedule) -> DType:
    """The dtype gradients leave the compute device in and rest in their home (every tier).

    bf16 compute: bf16 where a step stores each unit's grad once -- one micro-batch per step,
    or the vertical schedule, which sums the micro-batches on the device in fp32 first -- so
    nothing is ever added to a stored grad. The fp32 grad is rounded to the nearest bf16 (ties
    to even, as `.to(torch.bfloat16)`) and the optimizer upcasts it exactly; norms, clipping
    and the overflow check measure the rounded values. fp32 otherwise: where the horizontal
    schedule adds each micro-batch into the grad home (with `auto`, which the engine decides
    at the first step, it may), so accumulation stays exact; with fp32 compute; and with fp16,
    whose grads are stored unscaled, where most of them would underflow fp16."""
    summed_on_device = accumulate == 1 or schedule is Schedule.VERTICAL
    return DType.BF16 if compute is DType.BF16 and summed_on_device else DType.FP32


def grad_dtype_reason(compute: DType, accumulate: int, schedule: Schedule) -> str:
    """Why `grad_dtype` chose what it did, in a few words for `tierzero plan`."""
    if compute is DType.FP32:
        return "fp32 compute"
    if compute is DType.FP16:
        return "fp16 grads are stored unscaled, where most would underflow fp16"
    if accumulate == 1:
        return "one micro-batch per step: each grad is stored once"
    if schedule is Schedule.VERTICAL:
        return "the vertical schedule sums the micro-batches on the device, then stores once"
    if schedule is Schedule.HORIZONTAL:
        return "the horizontal schedule adds each micro-batch into the grad home"
    return (
        "--schedule auto decides at the first step and may add micro-batches into the grad "
        "home; --schedule vertical stores bf16"
    )


@dataclass(frozen=True)
class StateBytes:
    """How the optimizer's states are stored on every tier: the Adam moments' format and the
    master's dtype. `one_weight`: the param and the master are one bf16 tensor (bf16 compute,
    bf16 master), so a tier homing both holds it once."""

    optimizer_state: StateFormat = StateFormat.FP32
    master: DType = DType.FP32
    one_weight: bool = False

    def __post_init__(self) -> None:
        # spellings are coerced, not validated: `Config` and the CLI refuse bad ones with the fix
        object.__setattr__(self, "optimizer_state", StateFormat(self.optimizer_state))
        object.__setattr__(self, "master", DType(self.master))
        assert self.master in (DType.FP32, DType.BF16), (
            "masters are fp32 or bf16 (Config refuses fp16)"
        )
        assert not self.one_weight or self.master is DType.BF16, (
            "one weight tensor needs a bf16 master"
        )

    @classmethod
    def for_compute(
        cls, optimizer_state: StateFormat | str, master: DType | str, compute: DType
    ) -> StateBytes:
        """The formats a run computing in `compute` stores its state in: one weight tensor
        where both the compute dtype and the master are bf16."""
        master = DType(master)
        return cls(
            optimizer_state, master, one_weight=compute is DType.BF16 and master is DType.BF16
        )

    @property
    def compact(self) -> bool:
        """Whether any optimizer state is stored below fp32."""
        return self.optimizer_state is not StateFormat.FP32 or self.master is not DType.FP32

    def nbytes(
        self, kind: StateKind, numel: int, compute_itemsize: int, grad_itemsize: int | None = None
    ) -> int:
        """Bytes of `numel` consecutive elements of `kind`, stored as one run (an int8 run's
        scales: one per started block). Params (and by default grads) in the compute dtype."""
        if kind is StateKind.PARAM:
            return numel * compute_itemsize
        if kind is StateKind.GRAD:
            return numel * (compute_itemsize if grad_itemsize is None else grad_itemsize)
        return StateFormats(self.optimizer_state, self.master).nbytes(kind, numel)

    def per_param(
        self, kind: StateKind, compute_itemsize: int, grad_itemsize: int | None = None
    ) -> float:
        """Bytes per parameter of `kind` over whole blocks (int8: 1 + 4/STATE_BLOCK)."""
        return self.nbytes(kind, STATE_BLOCK, compute_itemsize, grad_itemsize) / STATE_BLOCK

    def describe(self) -> str:
        """One line for a run's start and `tierzero plan`."""
        moments = {
            StateFormat.FP32: "fp32 Adam moments",
            StateFormat.BF16: "bf16 Adam moments",
            StateFormat.INT8: f"int8 Adam moments (blocks of {STATE_BLOCK}, an fp32 scale each)",
        }
        weights = (
            "bf16 master (the param itself)" if self.one_weight else f"{self.master.value} master"
        )
        return f"{moments[self.optimizer_state]}, {weights}"


FP32_STATE = StateBytes()
