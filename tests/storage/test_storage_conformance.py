"""One conformance suite that every TierStore passes, bare and behind a latency wrapper.

Compares bytes: every read must return exactly what the last completed write stored (bf16 and
bool included), whatever the tier, the buffer alignment or the interleaving of operations.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
import torch
from tierzero.storage.base import DTYPES, Capabilities, ShardNotFoundError, StorageError, TierStore
from tierzero.storage.device import DevicePool, DeviceStore
from tierzero.storage.host import HostPool, HostStore
from tierzero.storage.io import IOLoop
from tierzero.storage.nvme.store import NvmeStore

CHUNK_BYTES = 16 << 10  # small chunks so that tests cover many-chunk shards cheaply


class LatencyStore(TierStore):
    """Wraps a store and sleeps a random moment before and after every call, reshuffling how
    concurrent operations interleave."""

    def __init__(self, inner: TierStore, seed: int) -> None:
        self.inner = inner
        self.tier = inner.tier  # type: ignore[misc]
        self._rng = random.Random(seed)

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    def open(self) -> None:
        self.inner.open()

    def close(self) -> None:
        self.inner.close()

    async def _nap(self) -> None:
        await asyncio.sleep(self._rng.random() * 0.003)

    async def write(self, key: str, src: torch.Tensor) -> None:
        await self._nap()
        await self.inner.write(key, src)
        await self._nap()

    async def read_into(self, key: str, out: torch.Tensor, verify: bool = False) -> None:
        await self._nap()
        await self.inner.read_into(key, out, verify)
        await self._nap()

    async def exists(self, key: str) -> bool:
        await self._nap()
        return await self.inner.exists(key)

    async def delete(self, key: str) -> None:
        await self._nap()
        await self.inner.delete(key)

    async def flush(self) -> None:
        await self._nap()
        await self.inner.flush()


def random_tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """Random bit patterns of every dtype (NaN payloads and all), so comparisons are bitwise."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


STORES = [
    "host",
    "device-cpu",
    "nvme-direct",
    "nvme-buffered",
    "nvme-striped",
    "latency-host",
    "latency-nvme",
]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[TierStore]:
    kind: str = request.param
    base = kind.removeprefix("latency-")
    pool = None
    if base == "host":
        pool = HostPool(64 << 20)
        inner: TierStore = HostStore(pool)
    elif base == "device-cpu":
        pool = DevicePool(64 << 20, "cpu")
        inner = DeviceStore(pool)
    elif base == "nvme-striped":
        dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
        for d in dirs:
            d.mkdir()
        inner = NvmeStore(dirs, chunk_bytes=CHUNK_BYTES)
    else:
        inner = NvmeStore(
            [tmp_path],
            chunk_bytes=CHUNK_BYTES,
            direct=None if base in ("nvme-direct", "nvme") else False,
        )
    s = LatencyStore(inner, seed=0) if kind.startswith("latency-") else inner
    if pool is not None:
        pool.open()
    with s:
        yield s
    if pool is not None:
        assert pool.resident_bytes <= pool.budget_bytes
        pool.close()


@pytest.fixture
def buffers() -> Iterator[HostPool]:
    """Aligned host buffers, the kind the engine hands to read_into."""
    with HostPool(64 << 20) as pool:
        yield pool


SIZES = [1, 1000, CHUNK_BYTES // 4, 3 * CHUNK_BYTES // 4 + 5]  # in elements


class TestConformance:
    @pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
    def test_round_trip_every_dtype_byte_exact(
        self, store: TierStore, io_loop: IOLoop, dtype: torch.dtype
    ) -> None:
        for i, numel in enumerate(SIZES):
            src = random_tensor(dtype, numel, seed=i)
            io_loop.run(store.write(f"state/u{i:04d}/r0", src))
            out = torch.empty(numel, dtype=dtype)
            io_loop.run(store.read_into(f"state/u{i:04d}/r0", out, verify=True))
            assert same_bytes(out, src), (dtype, numel)

    def test_aligned_and_unaligned_buffers(
        self, store: TierStore, io_loop: IOLoop, buffers: HostPool
    ) -> None:
        numel = 2 * CHUNK_BYTES // 4 + 7
        src = random_tensor(torch.float32, numel + 1, seed=1)[1:]  # starts 4 bytes off a page
        io_loop.run(store.write("master/u0001/r0", src))
        leased = buffers.lease(numel * 4)
        aligned = leased.view(torch.float32)
        unaligned = torch.empty(numel + 1, dtype=torch.float32)[1:]
        for out in (aligned, unaligned):
            io_loop.run(store.read_into("master/u0001/r0", out))
            assert same_bytes(out, src)
        buffers.give_back(leased)

    def test_concurrent_reads_and_writes(self, store: TierStore, io_loop: IOLoop) -> None:
        keys = [f"exp_avg/u{i:04d}/r{i % 2}" for i in range(12)]
        first = {
            k: random_tensor(torch.float32, 3000 + 997 * i, seed=i) for i, k in enumerate(keys)
        }
        second = {
            k: random_tensor(torch.float32, 3000 + 997 * i, seed=100 + i)
            for i, k in enumerate(keys)
        }

        async def scenario() -> dict[str, torch.Tensor]:
            await asyncio.gather(*(store.write(k, v) for k, v in first.items()))
            outs = {k: torch.empty_like(v) for k, v in first.items()}
            # Reads of the first version race writes of the second: each read must be one
            # version or the other, never a mix.
            await asyncio.gather(
                *(store.read_into(k, outs[k]) for k in keys),
                *(store.write(k, second[k]) for k in keys),
            )
            return outs

        outs = io_loop.run(scenario())
        for k in keys:
            assert same_bytes(outs[k], first[k]) or same_bytes(outs[k], second[k])
            final = torch.empty_like(second[k])
            io_loop.run(store.read_into(k, final, verify=True))
            assert same_bytes(final, second[k])

    def test_concurrent_writes_to_one_key_leave_one_whole_version(
        self, store: TierStore, io_loop: IOLoop
    ) -> None:
        versions = [random_tensor(torch.int32, 5000, seed=s) for s in range(6)]

        async def race() -> None:
            await asyncio.gather(*(store.write("grad/u0000/r0", v) for v in versions))

        io_loop.run(race())
        out = torch.empty(5000, dtype=torch.int32)
        io_loop.run(store.read_into("grad/u0000/r0", out, verify=True))
        assert any(same_bytes(out, v) for v in versions)

    def test_overwrite_with_another_size_and_dtype(self, store: TierStore, io_loop: IOLoop) -> None:
        big = random_tensor(torch.float32, 3 * CHUNK_BYTES // 4, seed=1)
        small = random_tensor(torch.bfloat16, 11, seed=2)
        io_loop.run(store.write("param/u0002/r1", big))
        io_loop.run(store.write("param/u0002/r1", small))
        out = torch.empty(11, dtype=torch.bfloat16)
        io_loop.run(store.read_into("param/u0002/r1", out, verify=True))
        assert same_bytes(out, small)
        with pytest.raises(StorageError, match="param/u0002/r1"):
            io_loop.run(store.read_into("param/u0002/r1", torch.empty_like(big)))

    def test_delete_and_exists(self, store: TierStore, io_loop: IOLoop) -> None:
        src = random_tensor(torch.float16, 100, seed=3)
        assert not io_loop.run(store.exists("grad/u0001/r0"))
        io_loop.run(store.write("grad/u0001/r0", src))
        assert io_loop.run(store.exists("grad/u0001/r0"))
        io_loop.run(store.delete("grad/u0001/r0"))
        assert not io_loop.run(store.exists("grad/u0001/r0"))
        with pytest.raises(ShardNotFoundError, match="grad/u0001/r0"):
            io_loop.run(store.read_into("grad/u0001/r0", torch.empty_like(src)))
        io_loop.run(store.delete("grad/u0001/r0"))  # deleting a missing key is a no-op

    def test_flush_keeps_everything_readable(self, store: TierStore, io_loop: IOLoop) -> None:
        src = {
            f"master/u{i:04d}/r0": random_tensor(torch.float32, 2000 * (i + 1), seed=i)
            for i in range(4)
        }
        for k, v in src.items():
            io_loop.run(store.write(k, v))
        io_loop.run(store.delete("master/u0000/r0"))
        io_loop.run(store.flush())
        for k, v in list(src.items())[1:]:
            out = torch.empty_like(v)
            io_loop.run(store.read_into(k, out, verify=True))
            assert same_bytes(out, v)

    def test_missing_key_and_bad_keys(self, store: TierStore, io_loop: IOLoop) -> None:
        with pytest.raises(ShardNotFoundError, match="exp_avg_sq/u0009/r0"):
            io_loop.run(store.read_into("exp_avg_sq/u0009/r0", torch.empty(4)))
        for bad in ("Master/u0", "a//b", "../etc", "a/b/", ""):
            with pytest.raises(StorageError, match="invalid shard key"):
                io_loop.run(store.write(bad, torch.zeros(4)))

    def test_wrong_out_is_refused_by_name(self, store: TierStore, io_loop: IOLoop) -> None:
        io_loop.run(store.write("master/u0001/r0", torch.arange(64, dtype=torch.float32)))
        with pytest.raises(StorageError, match=r"64 x float32 but out is 63 x torch.float32"):
            io_loop.run(store.read_into("master/u0001/r0", torch.empty(63)))
        with pytest.raises(StorageError, match="float32 but out is 64 x torch.float64"):
            io_loop.run(store.read_into("master/u0001/r0", torch.empty(64, dtype=torch.float64)))
        with pytest.raises(StorageError, match="contiguous 1-D"):
            io_loop.run(store.read_into("master/u0001/r0", torch.empty(8, 8)))
        with pytest.raises(StorageError, match="contiguous 1-D"):
            io_loop.run(store.write("master/u0001/r0", torch.empty(128)[::2]))

    def test_persistent_stores_survive_reopen(self, store: TierStore, io_loop: IOLoop) -> None:
        if not store.capabilities.persistent:
            pytest.skip("memory tiers are not persistent")
        src = random_tensor(torch.bfloat16, 7777, seed=5)
        io_loop.run(store.write("param/u0007/r0", src))
        io_loop.run(store.flush())
        store.close()
        store.open()
        out = torch.empty_like(src)
        io_loop.run(store.read_into("param/u0007/r0", out, verify=True))
        assert same_bytes(out, src)

    def test_zero_copy_view(self, store: TierStore, io_loop: IOLoop) -> None:
        if not store.capabilities.zero_copy:
            pytest.skip("only memory tiers are zero-copy")
        memory = getattr(store, "inner", store)
        assert isinstance(memory, (HostStore, DeviceStore))
        src = random_tensor(torch.float32, 100, seed=6)
        io_loop.run(store.write("param/u0000/r0", src))
        view = memory.view("param/u0000/r0")
        assert same_bytes(view, src)
        view[0] = 42.0
        out = torch.empty_like(src)
        io_loop.run(store.read_into("param/u0000/r0", out))
        assert out[0].item() == 42.0
