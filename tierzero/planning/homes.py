"""The homes: what each tier holds for the whole run, state kind by state kind.

A placement names each state kind's home tier; the stored dtype (`planning.statebytes`: params
in the compute dtype, grads in the planned grad dtype, master and moments in their formats)
says how many bytes it takes there. The memory model adds the homes to every phase's working
set (`memory_model.peak_memory`), the streaming ladder refuses a budget below them
(`homes_floor`), and `tierzero plan` says what each tier holds (`describe_homes`). Arithmetic
on unit sizes: it allocates nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from tierzero.config import DType, Placement, StateKind, Tier
from tierzero.planning.statebytes import FP32_NBYTES
from tierzero.planning.workload import Workload


def home_bytes(
    work: Workload,
    placement: Placement,
    host_keys: Callable[[StateKind], int] | None = None,
) -> dict[Tier, int]:
    """Bytes each tier's homes hold (gpu per rank, host and nvme per machine); a host home's
    keys as `host_keys(kind)` counts them (default: their bytes)."""
    w = work.world_size
    state = [u.state_numel(0) for u in work.units]
    param = sum(work.stored_param_nbytes())  # in the compute dtype, or a coded base as stored
    if work.one_weight(placement):  # the master holds the trained params: the param home, the
        # frozen rest
        param -= work.nbytes(StateKind.PARAM, sum(state))
    homes = {Tier.GPU: 0, Tier.HOST: 0, Tier.NVME: 0}
    for kind in StateKind:
        home = placement.home(kind)
        ranks = 1 if home is Tier.GPU else w
        if home is Tier.HOST and host_keys is not None:
            homes[home] += host_keys(kind)
        elif kind is StateKind.PARAM:
            homes[home] += param * ranks
        elif home is Tier.GPU:  # a device-pool key per piece
            homes[home] += sum(work.device_home_nbytes(kind, n) for n in state)
        else:  # each unit's run in its stored format
            homes[home] += sum(work.nbytes(kind, n) for n in state) * ranks
    if (
        w > 1 and work.stage == 1 and work.accumulate > 1
    ):  # each unit's whole fp32 gradient, between micro-batches
        full_grads = sum(min(u.padded_numel, u.trainable_numel) for u in work.units)
        homes[placement.grad] += full_grads * FP32_NBYTES * (1 if placement.grad is Tier.GPU else w)
    return homes


def homes_floor(work: Workload, placement: Placement) -> dict[Tier, int]:
    """What the homes alone take of each tier's budget, as `MemoryModel.needs` counts it (on the
    CPU device the host's includes the gpu tier's), whatever the piece size and prefetch depth:
    host keys at their own bytes, before the pool's blocks round them up. A budget below it fits
    no streaming setting (`tierzero.planning.streaming`); arithmetic on a few sums."""
    homes = home_bytes(work, placement)
    host = homes[Tier.HOST] + (work.world_size * homes[Tier.GPU] if work.device == "cpu" else 0)
    return {Tier.GPU: homes[Tier.GPU], Tier.HOST: host, Tier.NVME: homes[Tier.NVME]}


def stored_dtype(work: Workload, kind: StateKind, compute: DType) -> str:
    """How `kind` is stored by a run computing in `compute`, as a flag spells it: `bf16`,
    `fp32`, `int8` (grads are fp32 or in the compute dtype, as `work.grad_itemsize` says)."""
    if kind in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ):
        return work.formats.optimizer_state.value
    if kind is StateKind.MASTER:
        return work.formats.master.value
    if kind is StateKind.GRAD and work.grad_itemsize == FP32_NBYTES:
        return DType.FP32.value
    return compute.value


def describe_homes(work: Workload, placement: Placement, compute: DType) -> str:
    """One line: each tier and the state kinds it holds, each as `kind=dtype` in its stored
    dtype (`gpu: param=bf16; host: grad=bf16, master=fp32, ...; nvme: nothing`); an int8
    moment's fp32 absmax per block is `StateBytes.describe`'s to say."""
    one_weight = work.one_weight(placement)
    held: dict[Tier, list[str]] = {t: [] for t in Tier}
    for kind in StateKind:
        if kind is StateKind.MASTER and one_weight:
            continue  # said with the param
        text = f"{kind.value}={stored_dtype(work, kind, compute)}"
        if kind is StateKind.PARAM and one_weight:
            text += " (the master too)"
        held[placement.home(kind)].append(text)
    return "; ".join(
        f"{tier.value}: {', '.join(kinds) or 'nothing'}" for tier, kinds in held.items()
    )
