"""Exact clipping with the optimizer step beside backward.

overlap_step steps each unit before the global norm exists; the optimizer keeps the generation
each piece was stepped from and, where the clip fires, re-steps every piece from it with the
coefficient (`tierzero.engine.step.restep`). Compared bitwise with `clip_grad_norm_` + AdamW
(`ReferenceTrainer`), the clip firing and not, for host and nvme homes.
"""

from __future__ import annotations

import asyncio
import re
from functools import partial
from pathlib import Path

import pytest
import torch
from tierzero.storage.nvme.store import NvmeStore

from tests.support.engine import SMALL, batches, engine_config, reference_run
from tierzero import Placement, StateKind, Tier, models
from tierzero.engine import Engine
from tierzero.engine.step.restep import KeptGeneration
from tierzero.errors import ConfigError

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
HOST = Placement(Tier.GPU, Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST)
FIRES, NEVER_FIRES = 0.5, 1e6  # SMALL's grad norms are above 0.5 in these steps


# this file's values
config = partial(engine_config, total_steps=6, piece_numel=8192, overlap_step=True)


class CountingKept(KeptGeneration):
    """Counts the pieces each re-step restores (a re-step restores every kept piece once) and
    records what was copied rather than held on the drive."""

    restored = 0
    copied: set[StateKind] = set()

    def keep(self, unit, piece, start, end, runs, tensors) -> None:
        CountingKept.copied |= self.copied
        super().keep(unit, piece, start, end, runs, tensors)

    def restore(self, unit, piece, tensors) -> None:
        CountingKept.restored += 1
        super().restore(unit, piece, tensors)


@pytest.mark.parametrize(
    "placement, clip, accumulate",
    [
        (NVME, FIRES, 1),
        (NVME, NEVER_FIRES, 1),
        (HOST, FIRES, 1),
        (HOST, NEVER_FIRES, 1),
        (NVME, FIRES, 2),
    ],
    ids=[
        "nvme-fires",
        "nvme-never-fires",
        "host-fires",
        "host-never-fires",
        "nvme-fires-accumulate-2",
    ],
)
def test_overlapped_step_with_clipping_is_bitwise_the_reference(
    tmp_path, monkeypatch, placement, clip, accumulate
) -> None:
    monkeypatch.setattr("tierzero.engine.step.backward.KeptGeneration", CountingKept)
    CountingKept.restored, CountingKept.copied = 0, set()
    cfg = config(tmp_path, placement, clip_grad_norm=clip, accumulate=accumulate)
    ref_losses, ref_weights = reference_run(SMALL, cfg, steps=3)
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=cfg.seed), cfg) as engine:
        assert engine.parts.overlap
        losses = [engine.train_step(data.next_batch()) for _ in range(3 * accumulate)]
        weights = engine.master_state_dict()
        assert engine.opened.optimizer.kept is None  # settled: nothing kept between steps
        assert engine.last_grad_norm > FIRES
    assert losses == ref_losses
    assert weights.keys() == ref_weights.keys()
    for key in weights:
        assert torch.equal(weights[key], ref_weights[key]), key
    assert (CountingKept.restored > 0) == (clip == FIRES)  # re-stepped exactly when the clip fired
    # nvme-homed master and moments are kept as held generations on the drive, not copied
    assert CountingKept.copied == (
        {StateKind.GRAD}
        if placement == NVME
        else {StateKind.GRAD, StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ}
    )


def test_the_drive_holds_what_writes_replace_until_released(tmp_path) -> None:
    """`NvmeStore.hold`: a generation replaced while held stays whole and readable through
    writes and flushes (no recycling); released, the next flush recycles it."""
    key = "master/u0003/r0"

    def generations() -> list[Path]:
        return sorted(
            n for n in (tmp_path / "master/u0003/r0").iterdir() if re.fullmatch(r"g\d+", n.name)
        )

    async def run(store: NvmeStore) -> None:
        out = torch.empty(8192)
        await store.write(key, torch.full((8192,), 1.0))
        store.hold(True)
        for value in (2.0, 3.0):
            await store.write(key, torch.full((8192,), value))
            await store.flush()
        await store.read_into(key, out, previous=True)
        assert torch.equal(out, torch.full((8192,), 1.0))
        await store.read_into(key, out)
        assert torch.equal(out, torch.full((8192,), 3.0))
        assert len(generations()) == 3
        store.hold(False)
        await store.flush()
        assert len(generations()) == 1

    with NvmeStore([tmp_path], chunk_bytes=16 << 10) as store:
        asyncio.run(run(store))


def test_clipping_with_overlap_is_allowed_and_fp16_is_still_refused(tmp_path) -> None:
    """Asked for, overlap_step clips exactly without clip_previous_norm; fp16's overflow check
    is still refused (each unit's step would need it first)."""
    model = models.build(SMALL, device="meta")
    assert Engine(model, config(tmp_path, HOST, clip_grad_norm=FIRES)).parts.overlap
    with pytest.raises(ConfigError, match="fp16"):
        Engine(model, config(tmp_path, HOST, clip_grad_norm=FIRES, dtype="fp16"))
