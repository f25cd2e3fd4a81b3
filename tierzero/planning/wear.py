"""Drive wear: the NVMe bytes a run writes, against the drive's rated terabytes written (TBW).

A tiered trainer rewrites every NVMe-homed state each step (a 7B model with its optimizer on
NVMe writes tens of GB per step), so a long run can spend a visible share of a drive's rated
endurance. Owns `DriveWear` (a run's written bytes, per step and per run, and what share of a
rating they are), the bytes one checkpoint writes under a placement, and how many checkpoints
`tierzero train` takes in a run. `tierzero plan` projects it from the plan's bytes per step;
`tierzero train` fills it from what the run measured. Arithmetic only: it never reads a
counter or probes a drive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tierzero.config import Placement, StateKind, Tier
from tierzero.errors import ConfigError
from tierzero.planning.workload import Workload

TB = 10**12  # drive ratings are decimal terabytes written
WEAR_NOTE_FRACTION = 0.01  # a run that writes over 1% of the drive's rating gets a note
# what a checkpoint stores (gradients are not saved: a checkpoint sits between steps)
CHECKPOINTED_KINDS = (StateKind.PARAM, StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)


@dataclass(frozen=True)
class DriveWear:
    """What a run of `steps` optimizer steps writes to its drives: `step_bytes` by the steps
    and `checkpoint_bytes` by its `checkpoints` checkpoints (all of them, every rank's), and,
    with the drive's rating `drive_tbw` (terabytes written), what share of it that is."""

    steps: int
    step_bytes: int
    checkpoint_bytes: int = 0
    checkpoints: int = 0
    drive_tbw: float | None = None

    @classmethod
    def measured(
        cls,
        steps: int,
        nvme_bytes: int,
        process_bytes: int | None,
        checkpoints: int,
        drive_tbw: float | None,
    ) -> DriveWear:
        """A finished run's: `nvme_bytes` by the engine's NVMe write counters over its `steps`
        (every rank's), `process_bytes` by the kernel's count of this process's storage writes
        (None where it says nothing). What the process wrote beyond the steps' count -- its
        checkpoints, metrics and logs -- is the checkpoints' share, so the rating's is the
        larger of the two counts: the note errs towards warning."""
        extra = 0 if process_bytes is None else max(0, process_bytes - nvme_bytes)
        return cls(steps, nvme_bytes, extra, checkpoints, drive_tbw)

    @property
    def run_bytes(self) -> int:
        return self.step_bytes + self.checkpoint_bytes

    @property
    def per_step_bytes(self) -> float:
        """The steps' bytes per optimizer step (checkpoints apart)."""
        return self.step_bytes / max(1, self.steps)

    @property
    def rating_fraction(self) -> float | None:
        """The run's bytes over the drive's rating (None without a rating)."""
        return None if self.drive_tbw is None else self.run_bytes / (self.drive_tbw * TB)

    @property
    def per_1000_steps_fraction(self) -> float | None:
        """The rating's share 1000 steps at this run's rate use, checkpoints included."""
        fraction = self.rating_fraction
        return None if fraction is None else fraction * 1000 / max(1, self.steps)

    @property
    def over_note(self) -> bool:
        """Whether the run uses more than `WEAR_NOTE_FRACTION` of the rating."""
        fraction = self.rating_fraction
        return fraction is not None and fraction > WEAR_NOTE_FRACTION

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "step_bytes": self.step_bytes,
            "per_step_bytes": round(self.per_step_bytes),
            "checkpoints": self.checkpoints,
            "checkpoint_bytes": self.checkpoint_bytes,
            "run_bytes": self.run_bytes,
            "drive_tbw": self.drive_tbw,
            "rating_fraction": self.rating_fraction,
            "per_1000_steps_fraction": self.per_1000_steps_fraction,
            "note_fraction": WEAR_NOTE_FRACTION,
            "over_note": self.over_note,
        }


def check_drive_tbw(drive_tbw: float | None) -> None:
    """Refuse a rating that is not a positive number of terabytes written."""
    if drive_tbw is not None and not (
        isinstance(drive_tbw, (int, float))
        and not isinstance(drive_tbw, bool)
        and math.isfinite(drive_tbw)
        and drive_tbw > 0
    ):
        raise ConfigError(
            f"--drive-tbw must be the drive's rated endurance in terabytes written, a number "
            f"above 0 such as 600 (its datasheet's TBW), got {drive_tbw!r}"
        )


def checkpoints_taken(steps: int, checkpoint_every: int | None) -> int:
    """How many checkpoints `tierzero train` writes in `steps` steps: one every
    `checkpoint_every` and one at the end (only the end's when None)."""
    every = checkpoint_every or steps
    return steps // every + (1 if steps % every else 0)


def checkpoint_nbytes(work: Workload, placement: Placement) -> int:
    """Bytes one checkpoint writes, every rank's: the saved states whose home is in memory.
    NVMe-homed shards are hard-linked from the store (no bytes) where the run directory shares
    --nvme-path's filesystem, as `tierzero train`'s default (RUN_DIR/nvme) does. A param that
    is the master (one bf16 weight) is saved once, as the master; frozen params as params."""
    total = 0
    for kind in CHECKPOINTED_KINDS:
        if placement.home(kind) is Tier.NVME:
            continue
        if kind is StateKind.PARAM:  # as stored: a coded base's pieces are saved coded
            master = work.state_shard_numel if work.one_weight(placement) else 0
            total += work.param_nbytes() - work.nbytes(kind, master)
        else:
            total += work.state_nbytes(kind)
    return total * work.world_size


def step_nvme_written(
    one_pass_bytes: int,
    grad_bytes: int,
    accumulate: int,
    vertical: bool,
    spilled_bytes: int = 0,
    overlapped: bool = False,
) -> int:
    """NVMe bytes written by a step of `accumulate` micro-batches, from `one_pass_bytes`, those a
    step of one writes by the placement's traffic (`planning.placement`'s host->nvme bytes,
    which store every micro-batch's grads in their home): the write half of
    `swapplan.step_nvme_bytes`. Horizontally each further micro-batch writes the NVMe-homed
    grads again (`grad_bytes`); vertically the waiting activations spilled are written once.
    `overlapped` (overlap_step): the last micro-batch's grads go to the optimizer as they
    arrive, never to their home, so a step writes them once fewer (the engine's counters show
    it: 16 bytes a parameter, not 20, with fp32 state all on NVMe)."""
    stored = one_pass_bytes - (grad_bytes if overlapped else 0)
    if vertical:
        return stored + spilled_bytes
    return stored + (accumulate - 1) * grad_bytes
