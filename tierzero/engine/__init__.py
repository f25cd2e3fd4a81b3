"""The training step: `Engine` and the rooms it wires (runtime, step, vertical), sizing, gathered
weights, checkpointing."""

from tierzero.engine.engine import Engine

__all__ = ["Engine"]
