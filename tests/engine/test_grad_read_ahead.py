"""Grads homed on nvme: a later micro-batch's earlier sum is read a unit ahead, not on demand.

Autograd's thread adds each unit's earlier micro-batches' grad pieces to the new ones; the
reads of those pieces are issued one unit ahead (in the order micro-batch 0 accumulated the
units), so when a unit's grad arrives its reads were issued before it: the pass overlaps them
with the previous unit's add and this unit's backward. The result stays bitwise plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch
from tierzero.storage.host import HostStore
from tierzero.storage.nvme import NvmeStore

from tests.support.engine import batches, reference_run
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.engine.step.grads import GradShards
from tierzero.models import ModelArgs

ARGS = ModelArgs(
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=4,
    vocab_size=128,
    ffn_dim=64,
    max_seq_len=32,
    tie_embeddings=False,
)
ACCUMULATE = 3


def test_earlier_micro_batches_grads_are_read_before_their_unit_needs_them(
    tmp_path, monkeypatch
) -> None:
    cfg = Config(
        placement=Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME),
        nvme_path=[str(tmp_path)],
        lr=3e-3,
        total_steps=2,
        accumulate=ACCUMULATE,
        schedule="horizontal",
        overlap_step=False,
    )
    events: list[tuple[str, object]] = []
    issue, accumulate = GradShards._issue_read, GradShards._accumulate

    def recording_issue(self, key, stage):
        events.append(("read", key))
        return issue(self, key, stage)

    def recording_accumulate(self, unit, shard):
        events.append(("grad", (self.pass_.micro, unit)))
        return accumulate(self, unit, shard)

    monkeypatch.setattr(GradShards, "_issue_read", recording_issue)
    monkeypatch.setattr(GradShards, "_accumulate", recording_accumulate)
    _, ref = reference_run(ARGS, cfg, steps=2)
    data = batches()
    with Engine(models.build(ARGS, device="meta", seed=cfg.seed), cfg) as engine:
        for _ in range(2 * ACCUMULATE):
            engine.train_step(data.next_batch())
        weights = engine.master_state_dict()
    for key in ref:
        assert torch.equal(weights[key], ref[key]), key

    later = 0
    for at, (kind, what) in enumerate(events):
        if kind != "grad" or what[0] == 0:
            continue
        unit = what[1]
        issued_before = {k for kd, k in events[:at] if kd == "read" and f"u{unit:04d}/" in k}
        assert issued_before, f"micro-batch {what[0]}: unit {unit}'s earlier sum was not read ahead"
        later += 1
    assert later == 2 * (ACCUMULATE - 1) * len(engine.units)


TIED = ModelArgs(
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=4,
    vocab_size=128,
    ffn_dim=64,
    max_seq_len=32,
    tie_embeddings=True,
)


@pytest.mark.parametrize("home", [Tier.NVME, Tier.HOST])
def test_a_tied_units_stash_waits_on_the_host_not_in_the_grad_home(
    tmp_path, monkeypatch, home: Tier
) -> None:
    """The tied embedding's head-side grad waits in a host buffer until the embedding's own use
    ends backward: it never goes through the grad home (no store reads or writes of it), and
    that last use waits for nothing on the host (only the device waits, for the D2H copy)."""
    placement = Placement(Tier.NVME, home, Tier.NVME, Tier.NVME, Tier.NVME)
    cfg = Config(
        placement=placement,
        nvme_path=[str(tmp_path)],
        lr=3e-3,
        total_steps=2,
        accumulate=2,
        schedule="horizontal",
    )
    combine, last_uses, host_waits = GradShards._combine_uses, [], []

    def recording_combine(self, unit, grad):
        last = self.seen[unit] == self.uses[unit]
        waits = self.streams.host_wait
        self.streams.host_wait = lambda event: (host_waits.append(unit), waits(event))
        try:
            out = combine(self, unit, grad)
        finally:
            del self.streams.host_wait
        last_uses.extend([unit] if last else [])
        return out

    def no_stash(method):
        async def checked(self, key, *args, **kwargs):
            assert not key.startswith("grad_uses/"), (
                f"a tied unit's stash went through the grad home ({key})"
            )
            return await method(self, key, *args, **kwargs)

        return checked

    monkeypatch.setattr(GradShards, "_combine_uses", recording_combine)
    for store in (HostStore, NvmeStore):
        for name in ("write", "read_into"):
            monkeypatch.setattr(store, name, no_stash(getattr(store, name)))
    _, ref = reference_run(TIED, cfg, steps=2)
    last_uses.clear()  # only the tiered run's
    data = batches()
    with Engine(models.build(TIED, device="meta", seed=cfg.seed), cfg) as engine:
        for _ in range(4):
            engine.train_step(data.next_batch())
        weights = engine.master_state_dict()
    for key in ref:
        assert torch.equal(weights[key], ref[key]), key
    assert last_uses == [0] * 4 and not host_waits
