"""tierzero: train models whose state is larger than GPU memory by tiering it across GPU, host and NVMe."""

from tierzero import plan  # callable: tierzero.plan(model="7b", gpus=1, ...) -> PlanReport
from tierzero.config import Config, DType, Offload, Placement, StateKind, Tier
from tierzero.engine import Engine

__all__ = ["Config", "DType", "Engine", "Offload", "Placement", "StateKind", "Tier", "plan"]
