"""Host blocks from a few size classes, pinned once at open: counted, not timed.

Pinning is counted with the fake CUDA runtime of test_storage_host_pool (it also refuses to
pin twice or unpin what is not pinned). The size classes are checked against brute force, and
the memory model against the blocks the pool pins.
"""

from __future__ import annotations

import gc
import itertools
import random
from types import SimpleNamespace

import pytest
import torch
from tierzero.storage.base import BudgetExceededError
from tierzero.storage.host import HostPool
from tierzero.storage.sizeclass import choose_classes, class_for

from tests.support.engine import SMALL, batches
from tests.support.fakes.pinning import PAGE, FakeCudart
from tierzero import Config, Placement, Tier, models
from tierzero.engine import Engine
from tierzero.engine.vertical.boundary import BoundaryStore
from tierzero.planning.hostblocks import HOST_ALIGN, HOST_CLASSES
from tierzero.planning.memory_model import peak_memory
from tierzero.planning.workload import Workload

NVME = Placement(*[Tier.NVME] * 5)


def test_an_all_nvme_run_pins_only_before_it_moves_anything_and_unpins_only_at_close(
    tmp_path, cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No pinning in any step, no unpinning before close (before the size classes this run
    pinned 9 blocks in its first step, and under a 64 MiB budget 10 blocks pinned and unpinned
    in every step). Open pins the homes' and busiest moment's blocks; the other moments' and
    the LRU cache's, which the budget has room for, are pinned where the host budget is final:
    on CUDA at open, on the CPU device (here) when the first forward has taken the batch's
    activations from it, before that step's first nvme read."""
    cfg = Config(
        placement=NVME,
        nvme_path=[str(tmp_path / "nvme")],
        device="cpu",
        piece_numel=2048,
        dtype="bf16",
        total_steps=2,
        host_budget="64MiB",
        gpu_budget="64MiB",
    )
    data = batches()
    with Engine(models.build(SMALL, device="meta", seed=0), cfg) as engine:
        pool, memory = engine.parts.tiers.host_pool, engine.parts.sizing.current
        opened = list(cudart.registered)
        assert (
            pool.pin and len(opened) == sum(memory.host_blocks.values()) and not cudart.unregistered
        )
        extra = sum(memory.host_moment_blocks.values()) + sum(memory.host_cache_blocks.values())
        assert extra  # the first forward pins more: the checks below count them
        store, pinned_at_reads = engine.parts.tiers.stores[Tier.NVME], []
        real = store.read_into

        async def counted(key, out, verify=False):
            pinned_at_reads.append(len(cudart.registered))
            await real(key, out, verify)

        monkeypatch.setattr(store, "read_into", counted)
        for step in range(2):
            engine.train_step(data.next_batch())
            assert len(cudart.registered) == len(opened) + extra and not cudart.unregistered, step
        assert set(pinned_at_reads) == {len(opened) + extra}
        assert 0 < len(pool.classes) <= HOST_CLASSES
        assert set(pool.block_capacities) <= set(pool.classes)
    assert sorted(cudart.unregistered) == sorted(cudart.registered) and not cudart.pinned


def test_leases_round_up_to_their_class_and_blocks_stay_pinned(cudart: FakeCudart) -> None:
    with HostPool(6 * PAGE, blocks={PAGE: 2, 4 * PAGE: 1}) as pool:  # a budget it fills at open
        assert len(cudart.registered) == 3 and pool.resident_bytes == 6 * PAGE
        small = pool.lease(100)
        two = pool.lease(2 * PAGE)  # rounds up to the 4-page class
        assert pool.leased_bytes == 5 * PAGE and two.numel() == 2 * PAGE
        pool.cache_put("shard/u0000/r0", small)
        pool.give_back(small)  # cached, idle
        pool.give_back(two)
        other = pool.lease(PAGE)
        with pytest.raises(BudgetExceededError):  # grow=False: an idle block of its class, none is
            pool.lease(PAGE, grow=False)
        evicted = pool.lease(PAGE)  # no room: the cached block of its class, not the idle 4 pages
        assert evicted.data_ptr() == small.data_ptr() and pool.cache_get("shard/u0000/r0") is None
        pool.set_budget(64 * PAGE)
        grown = pool.lease(PAGE)  # room: one more of its class, pinned
        odd = pool.lease(9 * PAGE)  # above every class: a block of its own size, pinned
        for buf in (other, evicted, grown, odd):
            pool.give_back(buf)
        assert len(cudart.registered) == 5
        assert not cudart.unregistered  # give-backs and evictions keep every block pinned
        assert pool.block_capacities == {PAGE: 3, 4 * PAGE: 1, 9 * PAGE: 1}
    assert sorted(cudart.unregistered) == sorted(cudart.registered)


@pytest.mark.parametrize("seed", range(3))
def test_size_classes_waste_the_fewest_bytes(seed: int) -> None:
    rng = random.Random(seed)
    sizes = {
        rng.randrange(1, 40) * 1024 + rng.randrange(1024): rng.randrange(1, 6) for _ in range(9)
    }
    aligned = sorted({class_for(n, (), 1024) for n in sizes})

    def waste(classes: tuple[int, ...]) -> int:
        return sum(w * (class_for(n, classes, 1024) - n) for n, w in sizes.items())

    for k in (1, 3, 5):
        chosen = choose_classes(sizes, k, 1024)
        assert len(chosen) <= k and chosen[-1] == aligned[-1]  # the largest size fits a class
        best = min(
            waste(c + (aligned[-1],))
            for r in range(k)
            for c in itertools.combinations(aligned[:-1], r)
        )
        assert waste(chosen) == best


def test_the_memory_model_counts_the_blocks_the_pool_pins() -> None:
    """Units of many sizes, bf16 params and fp32 pieces, some host homes: more sizes than
    classes, so leases round up; the host pool's working set is exactly its blocks."""
    units = [
        ("embedding", 50000),
        ("b0", 70000),
        ("b1", 91000),
        ("b2", 110000),
        ("b3", 130000),
        ("head", 30000),
    ]
    placement = Placement(Tier.NVME, Tier.NVME, Tier.HOST, Tier.NVME, Tier.NVME)
    m = peak_memory(
        Workload.from_sizes(
            units, compute_itemsize=2, piece_numel=32768, device="cuda", overlap=False
        ),
        placement,
    )
    host = m.tiers[Tier.HOST]
    classes = tuple(sorted(m.host_blocks))
    assert len(classes) == HOST_CLASSES and all(c % HOST_ALIGN == 0 for c in classes)
    assert host.pool_bytes == sum(c * n for c, n in m.host_blocks.items())  # homes and working set
    # the grads' host home: one block per piece key, each at its class
    pieces = [
        min(32768, s - a) * 4
        for s in (51200, 71680, 92160, 110592, 131072, 30720)
        for a in range(0, s, 32768)
    ]
    assert host.homes_bytes == sum(class_for(n, classes, HOST_ALIGN) for n in pieces) > sum(pieces)

    # what the pool pins: its homes and busiest moment; other moments' and the cache's blocks
    # only as the budget has room for them
    def nbytes(blocks: dict[int, int]) -> int:
        return sum(c * n for c, n in blocks.items())

    assert m.host_provision(host.pool_bytes) == m.host_blocks
    moments = nbytes(m.host_moment_blocks)
    assert (
        moments and nbytes(m.host_provision(host.pool_bytes + moments)) == host.pool_bytes + moments
    )
    roomy = m.host_provision(host.pool_bytes + 10 * max(classes))
    assert nbytes(roomy) == host.pool_bytes + moments + m.host_cache_bytes


def test_waiting_activations_pin_their_own_pages_not_the_caching_allocators(
    cudart: FakeCudart,
) -> None:
    """The vertical schedule's host buffers on a GPU: each pinned as exactly its pages (a 3-page
    activation pins 3, where torch's caching host allocator pins 4 and never unpins them), and
    unpinned once the store drops it."""
    streams = SimpleNamespace(separate=True, device=torch.device("cpu"))
    store = BoundaryStore(SimpleNamespace(streams=streams), budget_bytes=64 * PAGE)
    three, five = store._take(3 * PAGE), store._take(5 * PAGE)
    ptrs = [three.data.data_ptr(), five.data.data_ptr()]
    assert cudart.pinned == {ptrs[0]: 3 * PAGE, ptrs[1]: 5 * PAGE}
    del three, five
    store.clear()
    gc.collect()
    assert sorted(cudart.unregistered) == sorted(ptrs) and not cudart.pinned
