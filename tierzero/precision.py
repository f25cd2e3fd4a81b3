"""Precision policy: which compute dtype a device can use, and the dynamic loss scaler for fp16.

Owns the dtype checks made before any state is written, and the scaler's arithmetic and state.
Master weights and Adam moments are always fp32; this module only decides the compute dtype.
It never touches tiers, shards or the optimizer: the engine asks
`DynamicLossScaler.update` and acts on the answer.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from tierzero.config import TORCH_DTYPES, DType
from tierzero.errors import ConfigError, TierzeroError
from tierzero.planning.machine import default_dtype


def compute_dtype(dtype: DType, device: torch.device) -> torch.dtype:
    """The torch dtype to compute in, after checking `device` can compute in it."""
    check_dtype_supported(dtype, device)
    return TORCH_DTYPES[dtype]


def check_dtype_supported(dtype: DType, device: torch.device) -> None:
    """Raise a ConfigError if `device` cannot run matmuls and their backward in `dtype`."""
    if dtype is DType.FP32:
        return
    if not supports(dtype, torch.device(device)):
        raise ConfigError(
            f"dtype {dtype.value} is not supported for compute on device '{device}'; "
            "use --dtype fp32 (or a device that has it)"
        )


def resolve_dtype(dtype: DType | None, device: torch.device) -> DType:
    """The configured dtype, or the device's default when none is configured."""
    return default_dtype(device) if dtype is None else dtype


@functools.cache
def supports(dtype: DType, device: torch.device) -> bool:
    """Whether `device` computes in `dtype` (the device boundary tests replace). Cached per
    (dtype, device): the CPU probe costs a kernel launch and an autograd pass."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            # emulated bf16 (pre-Ampere) computes, but at fp32 cost with bf16 rounding: not
            # "supported"
            return dtype is DType.FP16 or torch.cuda.is_bf16_supported(including_emulation=False)
    return probe_dtype(TORCH_DTYPES[dtype], device)


def probe_dtype(dtype: torch.dtype, device: torch.device) -> bool:
    """Try a tiny matmul and its backward in `dtype`: what the engine will ask of the device."""
    try:
        a = torch.ones(4, 4, dtype=dtype, device=device, requires_grad=True)
        (a @ a).sum().backward()
        return a.grad is not None and bool(torch.isfinite(a.grad).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class DynamicLossScaler:
    """fp16 loss scaling: multiply the loss by `scale`, halve it and skip the step on overflow,
    grow it after `growth_interval` consecutive good steps.

    The scale stays a power of two, so scaling and unscaling gradients is exact. Disabled
    (bf16/fp32), `scale` is 1.0 and `update` never asks for a skip.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_interval: int = 1000,
        backoff: float = 0.5,
        growth: float = 2.0,
        enabled: bool = True,
    ) -> None:
        if not _is_power_of_two(init_scale):
            raise ConfigError(f"loss scale must be a power of two (like 65536), got {init_scale}")
        if not _is_power_of_two(backoff) or not backoff < 1.0:
            raise ConfigError(
                f"loss scale backoff must be a power of two below 1 (like 0.5), got {backoff}"
            )
        if not _is_power_of_two(growth) or not growth > 1.0:
            raise ConfigError(
                f"loss scale growth must be a power of two above 1 (like 2), got {growth}"
            )
        if (
            isinstance(growth_interval, bool)
            or not isinstance(growth_interval, int)
            or growth_interval < 1
        ):
            raise ConfigError(
                f"loss scale growth interval must be an integer >= 1, got {growth_interval!r}"
            )
        self.enabled = enabled
        self.growth_interval = growth_interval
        self.backoff = backoff
        self.growth = growth
        self._scale = float(init_scale)
        self._good_steps = 0

    @property
    def scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def update(self, found_inf: bool) -> bool:
        """Record one step's overflow check; False means skip the step (and the scale was cut)."""
        if not self.enabled:
            return True
        if found_inf:
            self._scale *= self.backoff
            self._good_steps = 0
            return False
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self._scale *= self.growth
            self._good_steps = 0
        return True

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for a checkpoint (the settings come from the config, not from here)."""
        return {"scale": self._scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scale, good_steps = state.get("scale"), state.get("good_steps")
        if not (
            isinstance(scale, (int, float))
            and _is_power_of_two(scale)
            and isinstance(good_steps, int)
            and 0 <= good_steps < self.growth_interval
        ):
            raise TierzeroError(
                f"loss scaler state {state!r} is malformed; it needs a power-of-two "
                f"'scale' and 0 <= 'good_steps' < {self.growth_interval}"
            )
        self._scale = float(scale)
        self._good_steps = good_steps


def _is_power_of_two(x: float) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        return False
    mantissa, _ = math.frexp(x)
    return mantissa == 0.5
