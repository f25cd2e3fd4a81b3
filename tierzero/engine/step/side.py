"""Where this engine's optimizer steps (`planning.stepdevice`), decided once its placement and
stage are: the user's `--optimizer-device`, or under `auto` the faster side by this machine's
measured speeds, on the GPU only where its pool holds the optimizer's pieces beside the rest."""

from __future__ import annotations

import dataclasses

from tierzero.config import TORCH_DTYPES, OptimizerDevice, Placement
from tierzero.engine.sizing import Sizing, fits
from tierzero.errors import ConfigError
from tierzero.planning.stepdevice import NO_ROOM, StepRates, choose, measured_rates
from tierzero.planning.workload import steps_on_gpu


def step_side(sizing: Sizing, placement: Placement, stage: int) -> tuple[Placement, str]:
    """`placement` with where its optimizer steps (`Placement.optimizer`), and why."""
    c = sizing.config.execution.optimizer_device
    itemsizes = (sizing.dtype.itemsize, TORCH_DTYPES[sizing.grad_dtype].itemsize)
    device = "cpu" if sizing.device.type == "cpu" else "cuda"

    def rates() -> StepRates | None:  # measured only where `auto` weighs a GPU and the host
        return measured_rates(sizing.formats)

    homed = dataclasses.replace(placement, optimizer=None)
    if c is not OptimizerDevice.CPU and not steps_on_gpu(homed) and _keeps_generation(sizing):
        if c is OptimizerDevice.GPU:
            raise ConfigError(
                "--optimizer-device gpu cannot keep the generation that exact clipping beside "
                "backward re-steps from; add --clip-previous-norm, or step on the CPU "
                "(--optimizer-device cpu)"
            )
        return homed, "on the CPU: exact clipping beside backward keeps its states there"
    chosen, why = choose(placement, c, device, sizing.formats, itemsizes, sizing.overlap, rates)
    if chosen == homed or c is not OptimizerDevice.AUTO:
        return chosen, why
    if fits(sizing.memory(chosen, stage), sizing.budgets()):
        return chosen, why
    return homed, NO_ROOM


def _keeps_generation(sizing: Sizing) -> bool:
    """Whether a step beside backward keeps what a fired clip re-steps from (exact clipping:
    `engine.step.restep`), which a step on the device by choice does not."""
    opt = sizing.config.optimizer
    return sizing.overlap and opt.clip_grad_norm is not None and not opt.clip_previous_norm
