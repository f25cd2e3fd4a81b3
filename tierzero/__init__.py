"""tierzero: train models whose state is larger than GPU memory by tiering it across GPU, host and
NVMe."""

from tierzero.config import Config, DType, Offload, Placement, StateKind, Tier
from tierzero.engine import Engine
from tierzero.hf.plan import (
    plan,
)  # tierzero.plan(model="7b" or "hf:DIR", gpus=8, ...) -> PlanReport

__all__ = ["Config", "DType", "Engine", "Offload", "Placement", "StateKind", "Tier", "plan"]
