"""The training step: `Engine` and the parts it wires (tiers, scheduler, unit execution, grads, optimizer, snapshots)."""

from tierzero.engine.engine import Engine

__all__ = ["Engine"]
