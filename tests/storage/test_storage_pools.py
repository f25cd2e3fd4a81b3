"""HostPool and DevicePool: budgets, alignment, reuse and the LRU cache, counted not timed."""

from __future__ import annotations

import random

import pytest
import torch
from tierzero.storage.base import BudgetExceededError, StorageError
from tierzero.storage.device import DevicePool
from tierzero.storage.host import HostPool
from tierzero.storage.pool import BufferPool

KiB = 1024


def make_pools(budget: int) -> list[BufferPool]:
    return [HostPool(budget, pin=False), DevicePool(budget, "cpu")]


@pytest.fixture(params=["host", "device-cpu"])
def pool(request: pytest.FixtureRequest):
    p = HostPool(64 * KiB, pin=False) if request.param == "host" else DevicePool(64 * KiB, "cpu")
    with p:
        yield p


def test_leases_are_exact_and_aligned(pool: BufferPool) -> None:
    for nbytes in (1, 100, 4096, 5000):
        buf = pool.lease(nbytes)
        assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() == nbytes
        assert buf.data_ptr() % pool.alignment == 0
        pool.give_back(buf)


def test_given_back_blocks_are_reused(pool: BufferPool) -> None:
    a = pool.alignment
    buf = pool.lease(2 * a + 1)
    ptr = buf.data_ptr()
    pool.give_back(buf)
    again = pool.lease(3 * a)  # the same capacity class: 3 alignment units
    assert again.data_ptr() == ptr
    assert pool.resident_bytes == 3 * a
    pool.give_back(again)


@pytest.mark.parametrize("seed", range(5))
def test_randomized_workload_never_exceeds_the_budget(seed: int) -> None:
    rng = random.Random(seed)
    for pool in make_pools(256 * KiB):
        with pool:
            held: list[torch.Tensor] = []
            cached: list[str] = []
            refusals = 0
            for step in range(600):
                action = rng.random()
                if action < 0.45:
                    try:
                        held.append(
                            pool.lease(rng.choice([1, 3000, 4096, 10_000, 40_000, 100_000]))
                        )
                    except BudgetExceededError:
                        refusals += 1
                elif action < 0.55 and held:
                    key = f"shard/u{step:04d}/r0"
                    pool.cache_put(key, rng.choice(held))
                    cached.append(key)
                elif action < 0.65 and cached:
                    hit = pool.cache_get(rng.choice(cached))
                    if hit is not None:
                        held.append(hit)
                elif action < 0.7 and cached:
                    pool.cache_drop(cached.pop(rng.randrange(len(cached))))
                elif held:
                    pool.give_back(held.pop(rng.randrange(len(held))))
                assert pool.resident_bytes <= pool.budget_bytes
                assert pool.peak_bytes <= pool.budget_bytes
            assert refusals > 0  # the workload did press against the budget
            for buf in held:
                pool.give_back(buf)
            assert pool.leased_bytes == 0


def test_over_budget_lease_names_the_fix() -> None:
    with HostPool(64 * KiB, pin=False) as pool:
        with pytest.raises(BudgetExceededError, match="cannot lease 70000 bytes: budget 65536"):
            pool.lease(70_000)
        held = [pool.lease(16 * KiB) for _ in range(4)]
        with pytest.raises(BudgetExceededError, match="Raise the host budget"):
            pool.lease(1)
        assert pool.peak_bytes == 64 * KiB
        pool.give_back(held.pop())
        held.append(pool.lease(16 * KiB))


def test_idle_blocks_of_another_size_are_dropped_under_pressure() -> None:
    with HostPool(64 * KiB, pin=False) as pool:
        for _ in range(2):
            pool.give_back(pool.lease(32 * KiB))
        small = [pool.lease(4 * KiB) for _ in range(8)]  # must drop the idle 32 KiB block
        assert pool.resident_bytes <= 64 * KiB
        for buf in small:
            pool.give_back(buf)


def test_cache_evicts_least_recently_used_and_never_a_leased_entry() -> None:
    with HostPool(64 * KiB, pin=False) as pool:
        for name in ("a", "b", "c", "d"):
            buf = pool.lease(16 * KiB)
            buf.fill_(ord(name))
            pool.cache_put(name, buf)
            pool.give_back(buf)  # cached entries survive their lease
        hit_a = pool.cache_get("a")  # a: most recent, and leased
        assert hit_a is not None and int(hit_a[0]) == ord("a")
        fresh = pool.lease(32 * KiB)  # needs two entries evicted: b and c, not a
        assert [pool.cache_get(k) is None for k in "bc"] == [True, True]
        hit_d = pool.cache_get("d")
        assert hit_d is not None and int(hit_d[0]) == ord("d")
        with pytest.raises(BudgetExceededError):
            pool.lease(16 * KiB)  # a and d are both leased now
        pool.give_back(hit_d)
        pool.give_back(hit_a)
        pool.give_back(fresh)
        assert pool.cached_bytes == 32 * KiB
        pool.cache_drop("a")
        assert pool.cache_get("a") is None
        assert pool.resident_bytes <= pool.budget_bytes


def test_pool_misuse_is_named() -> None:
    pool = HostPool(64 * KiB, pin=False)
    with pytest.raises(StorageError, match="not open"):
        pool.lease(10)
    with pool:
        with pytest.raises(StorageError, match="not leased from this host pool"):
            pool.give_back(torch.empty(10, dtype=torch.uint8))
        buf = pool.lease(10)
        pool.give_back(buf)
        with pytest.raises(StorageError, match="once"):
            pool.give_back(buf)
        with pytest.raises(StorageError, match="cannot cache"):
            pool.cache_put("x", buf)
    with pytest.raises(StorageError, match="power of two"):
        HostPool(64 * KiB, alignment=3000)
    with pytest.raises(StorageError, match="positive"):
        DevicePool(0, "cpu")


def test_reset_peak() -> None:
    with HostPool(64 * KiB, pin=False) as pool:
        bufs = [pool.lease(16 * KiB) for _ in range(3)]
        for b in bufs[1:]:
            pool.give_back(b)
        pool.cache_put("keep", bufs[0])
        pool.give_back(bufs[0])
        assert pool.peak_bytes == 48 * KiB
        pool.close()
        pool.open()
        pool.reset_peak()
        assert pool.peak_bytes == 0
        pool.give_back(pool.lease(4 * KiB))
        assert pool.peak_bytes == 4 * KiB


def test_pin_follows_cuda_when_unspecified() -> None:
    with HostPool(64 * KiB) as pool:
        assert pool.pin == torch.cuda.is_available()
        buf = pool.lease(100)
        assert buf.is_pinned() == torch.cuda.is_available()
        pool.give_back(buf)
