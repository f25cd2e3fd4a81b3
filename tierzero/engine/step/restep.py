"""`KeptGeneration`: exact clipping with the optimizer step beside backward (overlap_step).

Each unit is stepped as soon as its grad is final, before the global grad norm exists. So that
the step stays bitwise `clip_grad_norm_` + AdamW, the optimizer keeps, per piece it steps, the
generation it stepped from: master and both moments as they were, the unclipped grad and the
runs with their step counts. Once the norm is known the step is settled: where the clip
coefficient is 1 the speculative step is the exact one (`clip_grad_norm_` multiplies by 1.0,
which changes nothing) and the copies are dropped; where it is below 1 every kept piece is
stepped again from its kept generation with the coefficient applied (`ShardOptimizer.step`
given `kept`), which rewrites master, moments and params in their homes.

What is kept where: master and moments homed on nvme keep their generation on the drive (the
store holds every superseded generation whole and readable until the step settles,
`NvmeStore.hold`: no copy, about 12 bytes per parameter of extra disk, and a re-step reads them
back); the others, and the grad (never stored beside backward), are copied on the stepping
device (host memory for a host step): 4 to 16 bytes per stepped parameter, held from the unit's
step to the end of `Engine.step`. The memory model does not count the copies.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tierzero.config import OPTIMIZER_KINDS, Placement, StateKind, Tier
from tierzero.engine.step.skipped import Run
from tierzero.layout.partition import Unit
from tierzero.storage.base import TierStore
from tierzero.storage.nvme.store import NvmeStore

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
    def __init__(self, copied: frozenset[StateKind], drive: NvmeStore | None) -> None:
        self.copied = copied  # what `keep` copies; the rest stays on `drive`, held
        self.drive = drive
        self._pieces: dict[tuple[int, int], KeptPiece] = {}
        self._lock = threading.Lock()

    @classmethod
    def begin(cls, placement: Placement, stores: Mapping[Tier, TierStore]) -> KeptGeneration:
        """Start keeping, before a step's first unit: nvme-homed master and moments stay on the
        drive (held), the rest is copied."""
        drive = stores.get(Tier.NVME)
        on_drive = (
            {k for k in OPTIMIZER_KINDS if placement.home(k) is Tier.NVME}
            if isinstance(drive, NvmeStore)
            else set()
        )
        if on_drive:
            drive.hold(True)
        return cls(
            frozenset(k for k in KEPT_KINDS if k not in on_drive), drive if on_drive else None
        )

    def end(self) -> None:
        """The step is settled: the drive retires what it held (recycled after the next flush)."""
        if self.drive is not None:
            self.drive.hold(False)

    def keep(
        self,
        unit: Unit,
        piece: int,
        start: int,
        end: int,
        runs: list[Run],
        tensors: dict[StateKind, torch.Tensor],
    ) -> None:
        """Copy a piece's grad, master and moments right before its speculative step (on the
        thread and, on a device, the stream that steps it)."""
        copies = {kind: tensors[kind].clone() for kind in self.copied}
        with self._lock:
            self._pieces.setdefault(
                (unit.index, piece), KeptPiece(unit, piece, start, end, list(runs), copies)
            )

    def pieces(self) -> list[KeptPiece]:
        """Every kept piece, in unit and piece order."""
        with self._lock:
            return [self._pieces[k] for k in sorted(self._pieces)]

    def restore(self, unit: int, piece: int, tensors: dict[StateKind, torch.Tensor]) -> None:
        """Put the copied master and moments back into a piece's working tensors (its home where
        they are used in place; held ones were read from the drive) and hand it the kept,
        unclipped grad, which the re-step consumes."""
        kept = self._pieces.pop((unit, piece))
        for kind in OPTIMIZER_KINDS:
            if kind in kept.tensors:
                tensors[kind].copy_(kept.tensors[kind])
        tensors[StateKind.GRAD] = kept.tensors[StateKind.GRAD]
