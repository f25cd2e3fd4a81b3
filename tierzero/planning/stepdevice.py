"""Where the optimizer steps: beside the host buffers, or on the compute device.

The step's arithmetic is the same on both: torch's fused AdamW for fp32 state; for compact
state the torch ops a device runs and the CPU kernel agree bitwise (IEEE sqrt, no contraction:
`tierzero.compact.step`). So the choice moves time, never a result.

Stepped on the device (`Placement.optimizer`), a piece's master and moments come up from their
homes through pinned host buffers and go back: bytes the host step does not move. Its grad,
made there, never comes down, and its new params are already where the next pass reads them:
bytes the host step does move. `auto` weighs the two sides from measured speeds -- the host's
optimizer step for the state's formats and the host<->device copies -- and takes the faster
(`choose`, whose sentence `tierzero plan` and the run's notes print). On a CPU compute device
there is one memory, so `auto` steps there as the states lie.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierzero.config import OPTIMIZER_KINDS, OptimizerDevice, Placement, StateKind, Tier
from tierzero.planning.speeds import h2d_gbps, optimizer_params_per_s
from tierzero.planning.statebytes import StateBytes
from tierzero.planning.workload import steps_on_gpu

GB = 1e9
NO_ROOM = "on the CPU: the GPU's budget has no room for the optimizer's pieces"


@dataclass(frozen=True)
class StepRates:
    """Measured on this machine: the host's optimizer step, parameters per second for the
    state's formats, and host<->device copies, bytes per second."""

    host_params_per_s: float
    link_bytes_per_s: float


def measured_rates(
    formats: StateBytes, link_gbps: float | None = None, host_params_per_s: float | None = None
) -> StepRates | None:
    """The host's step for `formats` (given, else measured briefly on this CPU) and the
    host<->device copy rate (given, e.g. a profile's, else this machine's GPU's); None where
    there is no copy rate to weigh."""
    if link_gbps is None and torch.cuda.is_available():
        link_gbps = h2d_gbps(seconds=0.2)
    if link_gbps is None:
        return None
    host = host_params_per_s or optimizer_params_per_s(formats, 0.2)
    return StepRates(host, link_gbps * GB)


@dataclass(frozen=True)
class Sides:
    """What each side of the link moves over it per parameter per step (both directions)."""

    host: float
    device: float


def link_bytes(
    placement: Placement,
    formats: StateBytes,
    compute_itemsize: int,
    grad_itemsize: int,
    overlap: bool,
) -> Sides:
    """Bytes per parameter crossing the host<->device link in one step, stepped on the host
    and on the device: a state whose home is on the other side goes there and back; the grad,
    handed over on the device in backward (`overlap`) or homed there, comes down to a host step,
    and one homed off the device (it came down in backward) goes up to a device step; new params
    go to a param home on the other side. A master that is the param moves as the param."""
    host = device = 0.0
    for kind in OPTIMIZER_KINDS:
        if kind is StateKind.MASTER and formats.one_weight:
            continue
        both_ways = 2 * formats.per_param(kind, compute_itemsize)
        if placement.home(kind) is Tier.GPU:
            host += both_ways
        else:
            device += both_ways
    grad_on_device = overlap or placement.home(StateKind.GRAD) is Tier.GPU
    host += grad_itemsize if grad_on_device else 0
    device += 0 if grad_on_device else grad_itemsize
    if placement.param is Tier.GPU:
        host += compute_itemsize
    else:
        device += compute_itemsize
    return Sides(host, device)


def choose(
    placement: Placement,
    choice: OptimizerDevice,
    device: str,
    formats: StateBytes,
    itemsizes: tuple[int, int],
    overlap: bool,
    rates: Callable[[], StepRates | None],
) -> tuple[Placement, str]:
    """`placement` with where its optimizer steps (`Placement.optimizer`), and why in one
    clause; `itemsizes`: the compute dtype's and the grads'; `overlap`: grads are stepped as
    backward makes them; `rates` is asked only where `auto` has two sides to weigh (None:
    not measured, so the host steps)."""
    homed = dataclasses.replace(placement, optimizer=None)
    on_device = dataclasses.replace(placement, optimizer=Tier.GPU)
    if steps_on_gpu(homed):
        return homed, "on the GPU, where master and moments live"
    if choice is OptimizerDevice.CPU:
        return homed, "on the CPU (--optimizer-device cpu)"
    if choice is OptimizerDevice.GPU:
        return on_device, "on the compute device (--optimizer-device gpu)"
    if device == "cpu":
        return homed, "on the CPU, the compute device"
    sides, r = link_bytes(placement, formats, *itemsizes, overlap), rates()
    if r is None:
        return homed, (
            "on the CPU: no host<->device copy rate was measured (`tierzero bench "
            "--profile-out` on the GPU machine, then `plan --profile`)"
        )
    host_s = max(1 / r.host_params_per_s, sides.host / r.link_bytes_per_s) * GB
    device_s = sides.device / r.link_bytes_per_s * GB
    measured = (
        f"the host steps {r.host_params_per_s / GB:.2f} G params/s and moves {sides.host:.1f} "
        f"B a param over the link, the GPU's step moves {sides.device:.1f} B at "
        f"{r.link_bytes_per_s / GB:.1f} GB/s: {host_s:.2f} against {device_s:.2f} s per "
        "billion params"
    )
    if device_s < host_s:
        return on_device, f"on the GPU: {measured}"
    return homed, f"on the CPU: {measured}"
