"""`BoundaryStore` driven directly: entries of two sizes through a budget that makes a
prefetched entry give its buffer up again -- the branch a vertical step takes when a tied
embedding's grad from the head (larger than an activation) needs room that read-backs hold.
Every entry comes back bitwise what was put."""

from __future__ import annotations

import torch

from tierzero import Config, Placement, Tier
from tierzero.engine.runtime.tiers import Tiers
from tierzero.engine.vertical.boundary import BoundaryStore

NVME = Placement(Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME, Tier.NVME)
NUMEL = 4096  # 16 KiB of fp32: one activation; the large entry is twice that


def test_a_prefetched_entry_gives_its_buffer_up_to_a_larger_put(tmp_path, monkeypatch) -> None:
    (tmp_path / "nvme").mkdir()
    config = Config(placement=NVME, nvme_path=[str(tmp_path / "nvme")])
    tiers = Tiers(
        config.tiering,
        config.streaming,
        config.formats,
        torch.device("cpu"),
        {Tier.NVME, Tier.HOST, Tier.GPU},
    ).open()
    submit = tiers.submit

    def at_once(work):  # each I/O done before the store looks again: no races
        future = submit(work)
        future.result()
        return future

    monkeypatch.setattr(tiers, "submit", at_once)  # the I/O loop's boundary
    try:
        store = BoundaryStore(tiers, budget_bytes=3 * NUMEL * 4)
        values = {(u, m): torch.randn(NUMEL) for u in (1, 2, 3) for m in (0, 1)}
        for key, x in values.items():  # forward order: (1, 0), (1, 1), (2, 0) are spilled
            store.put(*key, x)
        for key in [(3, 0), (3, 1)]:
            assert torch.equal(store.get(*key), values[key]), key
        store.prefetch()  # (2, 0) and (1, 0) are read back into the freed room
        large = torch.randn(2 * NUMEL)
        store.put(0, 0, large)  # spills (2, 1), then takes (1, 0)'s buffer back
        assert store.spilled == 4
        assert torch.equal(store.get(0, 0), large)
        for key in [(2, 0), (2, 1), (1, 0), (1, 1)]:  # backward order
            assert torch.equal(store.get(*key), values[key]), key
        assert store.peak_bytes <= store.budget_bytes
    finally:
        tiers.close()
