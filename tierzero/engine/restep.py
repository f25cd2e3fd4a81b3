"""`KeptGeneration`: exact clipping with the optimizer step beside backward (overlap_step).

Each unit is stepped as soon as its grad is final, before the global grad norm exists. So that
the step stays bitwise `clip_grad_norm_` + AdamW, the optimizer keeps, per piece it steps, the
generation it stepped from: master and both moments as they were, the unclipped grad and the
runs with their step counts. Once the norm is known the step is settled: where the clip
coefficient is 1 the speculative step is the exact one (`clip_grad_norm_` multiplies by 1.0,
which changes nothing) and the copies are dropped; where it is below 1 every kept piece is
stepped again from its kept generation with the coefficient applied (`ShardOptimizer.step`
given `kept`), which rewrites master, moments and params in their homes.

The copies are plain tensors on the stepping device (host memory for a host step, whatever the
homes: nvme-homed states are copied from the buffers they were read into), 16 bytes per
stepped parameter held from the unit's step to the end of `Engine.step`; the memory model does
not count them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from tierzero.config import OPTIMIZER_KINDS, StateKind
from tierzero.engine.paramsteps import Run
from tierzero.layout.partition import Unit

KEPT_KINDS = (StateKind.GRAD, *OPTIMIZER_KINDS)


@dataclass(frozen=True)
class KeptPiece:
    """One stepped piece's range, runs and the values it was stepped from."""

    unit: Unit
    piece: int
    start: int
    end: int
    runs: list[Run]
    tensors: dict[StateKind, torch.Tensor]


class KeptGeneration:
    def __init__(self) -> None:
        self._pieces: dict[tuple[int, int], KeptPiece] = {}
        self._lock = threading.Lock()

    def keep(self, unit: Unit, piece: int, start: int, end: int, runs: list[Run],
             tensors: dict[StateKind, torch.Tensor]) -> None:
        """Copy a piece's grad, master and moments right before its speculative step (on the
        thread and, on a device, the stream that steps it)."""
        copies = {kind: tensors[kind].clone() for kind in KEPT_KINDS}
        with self._lock:
            self._pieces.setdefault((unit.index, piece), KeptPiece(unit, piece, start, end, list(runs), copies))

    def pieces(self) -> list[KeptPiece]:
        """Every kept piece, in unit and piece order."""
        with self._lock:
            return [self._pieces[k] for k in sorted(self._pieces)]

    def restore(self, unit: int, piece: int, tensors: dict[StateKind, torch.Tensor]) -> None:
        """Put the kept master and moments back into a piece's working tensors (its home where
        they are used in place) and hand it the kept, unclipped grad, which the re-step consumes."""
        kept = self._pieces.pop((unit, piece))
        for kind in OPTIMIZER_KINDS:
            tensors[kind].copy_(kept.tensors[kind])
        tensors[StateKind.GRAD] = kept.tensors[StateKind.GRAD]

