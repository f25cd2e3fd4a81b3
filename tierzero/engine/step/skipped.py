"""Per-parameter AdamW step counts: a parameter without a gradient in a step is skipped.

torch's AdamW steps only the parameters whose `.grad` is not None (no moment update, no weight
decay) and keeps a step count per parameter, so a parameter skipped once is bias-corrected with
its own, smaller count from then on. The engine steps flat shards; this module says which runs
of a shard a step updates and with which count, and remembers how many steps each parameter
missed (sparse: a model whose parameters all get gradients stores nothing).

It never touches tensors: runs are offsets, counts are integers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from tierzero.errors import CheckpointError
from tierzero.layout.partition import Unit

Run = tuple[
    int, int, bool, int
]  # (start, end) in shard-local offsets, decays, updates already applied


class SkippedSteps:
    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        self.skipped: dict[str, int] = {}  # a parameter's first name -> optimizer steps it missed

    def runs(self, unit: Unit, rank: int, present: Collection[int], step_count: int) -> list[Run]:
        """The runs of this rank's shard of `unit` to update in the step after `step_count`
        updates: the slots in `present` (those that got a gradient), adjacent ones with the same
        weight decay and count merged, so a model without skips steps two runs per shard."""
        lo, hi = unit.shard_range(rank)
        runs: list[Run] = []
        for i, slot in enumerate(unit.slots):
            a, b = max(slot.offset, lo) - lo, min(slot.end, hi) - lo
            if slot.frozen or i not in present or b <= a:
                continue
            step = step_count - self.skipped.get(slot.names[0], 0)
            if runs and runs[-1][1] == a and runs[-1][2:] == (slot.decays, step):
                runs[-1] = (runs[-1][0], b, slot.decays, step)
            else:
                runs.append((a, b, slot.decays, step))
        return runs

    def advance(self, present: Mapping[int, Collection[int]]) -> None:
        """After a step: every trainable parameter that got no gradient missed it."""
        for unit in self.units:
            got = present.get(unit.index, ())
            for i, slot in enumerate(unit.slots):
                if not slot.frozen and i not in got:
                    self.skipped[slot.names[0]] = self.skipped.get(slot.names[0], 0) + 1

    def state_dict(self) -> dict[str, int]:
        return dict(self.skipped)

    def load_state_dict(self, state: Mapping[str, int], where: str) -> None:
        names = {s.names[0] for u in self.units for s in u.slots if not s.frozen}
        unknown = sorted(set(state) - names)
        if unknown:
            raise CheckpointError(
                f"{where} counts skipped steps of '{unknown[0]}', which is not a trainable "
                "parameter of this model; resume with the model that wrote it"
            )
        self.skipped = {str(k): int(v) for k, v in state.items()}
