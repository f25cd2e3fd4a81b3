"""HostPool's memory: exact page-aligned mappings, returned when dropped, pinned and unpinned once.

Pinning is tested against a fake CUDA runtime that records cudaHostRegister/Unregister, so
these run without a GPU; the mappings themselves are real and watched through weak references.
"""

from __future__ import annotations

import random

import pytest
import torch
from tierzero.storage.base import BudgetExceededError, StorageError
from tierzero.storage.host import HostPool, pinned_empty

from tests.support.fakes.pinning import PAGE, FakeCudart, Mappings


def test_blocks_are_exact_page_aligned_mappings() -> None:
    with HostPool(64 * PAGE, pin=False, alignment=512) as pool:
        assert pool.alignment == PAGE  # a block is whole pages of real memory
        for nbytes, pages in ((1, 1), (PAGE, 1), (PAGE + 1, 2), (2 * PAGE + 100, 3)):
            buf = pool.lease(nbytes)
            storage = buf.untyped_storage()
            assert buf.numel() == nbytes and buf.data_ptr() == storage.data_ptr()
            assert storage.nbytes() == pages * PAGE and storage.data_ptr() % PAGE == 0
            pool.give_back(buf)
        assert pool.resident_bytes == (1 + 2 + 3) * PAGE


def test_an_alignment_above_the_page_size_is_honoured() -> None:
    with HostPool(64 * PAGE, pin=False, alignment=4 * PAGE) as pool:
        buf = pool.lease(100)
        assert buf.data_ptr() % (4 * PAGE) == 0
        assert pool.resident_bytes == 4 * PAGE
        pool.give_back(buf)


def test_memory_goes_back_when_the_pool_drops_a_block(mappings: Mappings) -> None:
    with HostPool(16 * PAGE, pin=False) as pool:
        pool.give_back(pool.lease(12 * PAGE))  # idle on the free list
        assert mappings.live() == 1
        big = pool.lease(8 * PAGE)  # does not fit beside the idle block: it is dropped
        assert mappings.live() == 1 and pool.resident_bytes == 8 * PAGE
        pool.cache_put("shard", big)
        pool.give_back(big)
        del big
        small = pool.lease(12 * PAGE)  # evicts the cached shard
        assert mappings.live() == 1
        pool.give_back(small)
        del small
    assert mappings.live() == 0  # close() forgot the last one; nobody else held it


def test_buffers_held_across_close_stay_valid(mappings: Mappings) -> None:
    pool = HostPool(16 * PAGE, pin=False)
    with pool:
        buf = pool.lease(5000).view(torch.int32)
        buf.fill_(7)
    assert pool.resident_bytes == 0 and mappings.live() == 1
    assert int(buf.sum()) == 7 * 1250
    del buf
    assert mappings.live() == 0


def test_pinning_follows_the_blocks_the_pool_holds(cudart: FakeCudart) -> None:
    rng = random.Random(0)
    budget = 64 * PAGE
    with HostPool(budget) as pool:
        assert pool.pin
        held: list[torch.Tensor] = []
        for step in range(600):
            action = rng.random()
            if action < 0.45:
                try:
                    held.append(
                        pool.lease(rng.choice([1, PAGE + 1, 3 * PAGE, 10 * PAGE, 25 * PAGE]))
                    )
                except BudgetExceededError:
                    pass
            elif action < 0.55 and held:
                pool.cache_put(f"shard/u{step:04d}/r0", rng.choice(held))
            elif held:
                pool.give_back(held.pop(rng.randrange(len(held))))
            assert sum(cudart.pinned.values()) == pool.resident_bytes
        assert cudart.unregistered  # blocks were dropped (trimmed or evicted) while open
        assert cudart.peak_pinned_bytes <= budget
    assert cudart.pinned == {}  # close() unpinned the rest
    assert sorted(cudart.registered) == sorted(cudart.unregistered)
    for buf in held:
        buf.fill_(1)  # still mapped, only unpinned


def test_each_pin_is_undone_once_on_drop_and_on_close(cudart: FakeCudart) -> None:
    with HostPool(16 * PAGE) as pool:
        pool.give_back(pool.lease(12 * PAGE))
        first = cudart.registered[0]
        held = pool.lease(8 * PAGE)  # drops the idle 12-page block
        assert cudart.unregistered == [first]
        cached = pool.lease(4 * PAGE)
        pool.cache_put("shard", cached)
        pool.give_back(cached)
    assert cudart.pinned == {}
    assert sorted(cudart.unregistered) == sorted(cudart.registered)
    assert len(cudart.unregistered) == 3
    held.fill_(1)


def test_a_refused_pin_names_the_fix(monkeypatch: pytest.MonkeyPatch, mappings: Mappings) -> None:
    fake = FakeCudart(mappings, fail_with=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    with HostPool(16 * PAGE) as pool:
        with pytest.raises(
            StorageError, match=rf"cannot pin {2 * PAGE} bytes .*error 2.*ulimit -l"
        ):
            pool.lease(PAGE + 1)
        assert pool.resident_bytes == 0 and pool.peak_bytes == 0
    assert mappings.live() == 0


def test_pin_without_cuda_is_refused_at_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(StorageError, match="needs CUDA.*pin=None.*pin=False"):
        HostPool(16 * PAGE, pin=True).open()
    with HostPool(16 * PAGE) as pool:
        assert not pool.pin
        pool.give_back(pool.lease(10))


def test_a_block_that_fails_to_unpin_is_never_unmapped(
    cudart: FakeCudart, mappings: Mappings
) -> None:
    pool = HostPool(16 * PAGE)
    with pool:
        pool.give_back(pool.lease(12 * PAGE))
        cudart.fail_unpin_with = 1
        with pytest.raises(StorageError, match="cannot unpin"):
            pool.lease(8 * PAGE)  # dropping the idle block fails to unpin it
        assert pool.resident_bytes == 0
        cudart.fail_unpin_with = 0
        first, second = pool.lease(4 * PAGE), pool.lease(4 * PAGE)
        pool.give_back(first)
        pool.give_back(second)
        cudart.fail_unpin_with = 1
        with pytest.raises(StorageError, match="cannot unpin"):
            pool.close()  # tries every block, raises the first failure
    del first, second
    assert mappings.live() == 3  # still pinned, so kept mapped for the life of the pool
    assert len(cudart.pinned) == 3


@pytest.mark.cuda
def test_pinned_blocks_copy_asynchronously_on_a_gpu() -> None:
    with HostPool(4 << 20) as pool:
        host = pool.lease(1 << 20)
        assert host.is_pinned()
        host.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            gpu = host.to("cuda", non_blocking=True)
            back = pool.lease(1 << 20)
            back.copy_(gpu, non_blocking=True)
        stream.synchronize()
        assert torch.equal(back, host)
        pool.give_back(host)
        pool.give_back(back)
    assert not host.is_pinned()  # close() unpinned it; the memory itself stays valid


def test_a_pinned_buffer_outside_the_pool_is_its_own_pages_unpinned_before_they_are_unmapped(
    cudart: FakeCudart, mappings: Mappings
) -> None:
    """`pinned_empty`: exactly the pages asked for (torch's caching host allocator would pin a
    power of two and keep it), pinned once, unpinned when its last view dies while still mapped
    (the fake refuses an unpin of unmapped memory)."""
    buf = pinned_empty(3 * PAGE + 1)
    view = buf[PAGE:]
    ptr = buf.data_ptr()
    assert buf.numel() == 3 * PAGE + 1 and ptr % PAGE == 0
    assert cudart.pinned == {ptr: 4 * PAGE}
    del buf
    assert cudart.pinned == {ptr: 4 * PAGE}  # a view still holds it
    view.fill_(7)
    del view
    assert cudart.unregistered == [ptr] and not cudart.pinned and mappings.live() == 0
