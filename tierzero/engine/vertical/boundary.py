"""`BoundaryStore`: the vertical schedule's waiting activations, in host memory under a byte
budget, spilled to the NVMe store when the budget is full and read back before they are needed.

With the vertical schedule (`tierzero.engine.vertical.schedule`) every micro-batch's input to every
block waits from that block's forward to its backward, k times what one micro-batch keeps.
They are kept here, keyed by (unit, micro-batch), never on the compute device between uses.

Order is what makes one small policy enough. `put` runs in forward order (units ascending, each
unit's micro-batches in order) and `get` in backward order (units descending), so the entries
needed last are the oldest: when the budget is full the oldest resident entry is written to
NVMe (`act/u<unit>/m<micro>`) and its buffer freed once written, and as `get` frees room,
`prefetch` reads spilled entries back, the next needed first. Every host buffer counts against
the budget from allocation until what frees it has happened: its write, or its copy to the
device (`peak_bytes` is asserted in tests); a prefetched entry gives its buffer up again when
an entry put later needs the room. A freed buffer is kept for the next entry of its size
(allocating, and on a GPU pinning, per activation would sit on every micro-batch's path);
kept and used buffers together stay within the budget. Keys are overwritten step after step
(new generations of the same arrays), never deleted.

On a GPU the buffers are pinned, an activation goes to the host on the d2h stream after the
compute that produced it, a spill write waits for that copy on an I/O thread, and it comes
back on a stream of its own (`Streams.h2d_act`), one entry ahead of its use (`get` starts the
next one's copy, `stage_next`), compute waiting for its event: never behind param fetches
that wait for buffer releases. On the CPU device copies are memcpys.
"""

from __future__ import annotations

import concurrent.futures
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tierzero.config import Tier
from tierzero.engine.runtime.streams import Event
from tierzero.engine.runtime.tiers import Tiers
from tierzero.errors import ConfigError
from tierzero.planning.placement import Link
from tierzero.storage.base import ALIGN_BYTES, TierStore, aligned_empty
from tierzero.storage.host import pinned_empty


@dataclass(eq=False)  # found by identity (`list.remove`): comparing tensors by value is ambiguous
class _Buffer:
    """One host buffer, counted until `free_after` (None: its entry still holds it) is done."""

    data: torch.Tensor  # uint8, its size a multiple of ALIGN_BYTES
    free_after: concurrent.futures.Future | None = None


@dataclass
class _Entry:
    shape: torch.Size
    dtype: torch.dtype
    buffer: _Buffer | None  # None: on NVMe only
    landed: Event = None  # its copy into `buffer`
    written: concurrent.futures.Future | None = None  # its spill write
    read: concurrent.futures.Future | None = None  # a prefetch into `buffer`
    up: tuple[torch.Tensor, Event] | None = (
        None  # on its way to the device: the tensor, its copy's event
    )

    @property
    def nbytes(self) -> int:
        """Its bytes, rounded up to direct I/O's alignment (its buffer may be a larger reused
        one)."""
        return aligned_nbytes(self.shape.numel() * self.dtype.itemsize)

    def raw(self) -> torch.Tensor:
        """The first `nbytes` of its buffer: what is written to and read from NVMe."""
        assert self.buffer is not None
        return self.buffer.data[: self.nbytes]

    def view(self) -> torch.Tensor:
        assert self.buffer is not None
        numel = self.shape.numel()
        return self.buffer.data[: numel * self.dtype.itemsize].view(self.dtype).view(self.shape)


class BoundaryStore:
    def __init__(
        self, tiers: Tiers, budget_bytes: int, name: str = "act", in_put_order: bool = False
    ) -> None:
        """`name`: its NVMe keys' prefix. `in_put_order`: `get` takes entries in the order they
        were put (an evaluation pass, `tierzero.engine.vertical.evaluate`), not backward order;
        the entry then spilled when the budget is full is the newest, the one needed last."""
        self.tiers = tiers
        self.budget_bytes = budget_bytes
        self.name = name
        self.in_put_order = in_put_order
        self._order = _put_key if in_put_order else _backward_key
        self.peak_bytes = 0
        self.spilled = 0  # entries written to NVMe since open
        self._entries: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._buffers: list[_Buffer] = []
        self._idle: list[torch.Tensor] = []  # freed buffers, reused by the next entry of their size

    @property
    def used_bytes(self) -> int:
        return sum(b.data.numel() for b in self._buffers)

    def put(self, unit: int, micro: int, x: torch.Tensor) -> None:
        """Keep `x` (on the compute device) until `get(unit, micro)`."""
        s = self.tiers.streams
        buffer = self._allocate(aligned_nbytes(x.numel() * x.element_size()))
        entry = _Entry(x.shape, x.dtype, buffer)
        entry.landed = s.copy(entry.view(), x, s.d2h, after=s.record(s.compute))
        s.keep_alive(x, s.d2h)
        if s.separate:
            self.tiers.stats.add_bytes(Link.GPU_TO_HOST, entry.nbytes)
        self._entries[(unit, micro)] = entry

    def get(self, unit: int, micro: int) -> torch.Tensor:
        """The activation `put` under (unit, micro), on the compute device; its buffer is freed,
        and the next entry's copy to the device is started."""
        entry = self._entries.pop((unit, micro))
        if entry.up is None:
            if entry.buffer is None:  # on NVMe and not prefetched: read it now
                self._wait(entry.written)
                entry.buffer = self._allocate(entry.nbytes)
                self._read(unit, micro, entry)
            self._wait(entry.read)
            self._up(entry)
        assert entry.up is not None and entry.buffer is not None
        (out, copied), s = entry.up, self.tiers.streams
        s.wait(s.compute, copied)
        s.keep_alive(out, s.compute)
        entry.buffer.free_after = self.tiers.when_done(copied)
        self.stage_next()
        return out

    def stage_next(self) -> None:
        """Start the copy to the device of the entry `get` takes next, if it is in host memory
        (a read back from NVMe still in flight is not waited for)."""
        entry = min(self._entries.items(), key=self._order, default=(None, None))[1]
        if (
            entry is not None
            and entry.up is None
            and entry.buffer is not None
            and (entry.read is None or entry.read.done())
        ):
            self._up(entry)

    def _up(self, entry: _Entry) -> None:
        """Copy an entry in host memory to the device on the activations' own stream."""
        s = self.tiers.streams
        with s.current(s.h2d_act):  # allocated for the stream that writes it
            out = torch.empty(entry.shape, dtype=entry.dtype, device=s.device)
        entry.up = out, s.copy(out, entry.view(), s.h2d_act, after=entry.landed)
        if s.separate:
            self.tiers.stats.add_bytes(Link.HOST_TO_GPU, entry.nbytes)

    def prefetch(self) -> None:
        """Read spilled entries back, the next needed first (backward order), while they fit."""
        self._reap()
        for (unit, micro), entry in self._get_order():
            if entry.buffer is not None:
                continue
            if self.used_bytes + entry.nbytes > self.budget_bytes or not entry.written.done():
                return
            entry.buffer = self._take(entry.nbytes)
            self._read(unit, micro, entry)

    def clear(self) -> None:
        """Forget every entry (after an error in the middle of a step); wait for I/O in flight."""
        for entry in self._entries.values():
            self.tiers.streams.host_wait(
                entry.landed
            )  # a copy into a buffer about to be unpinned and unmapped
            if entry.up is not None:
                self.tiers.streams.host_wait(entry.up[1])  # and one out of it
            for future in (entry.written, entry.read):
                if future is not None:
                    future.exception()
        for buffer in self._buffers:
            if buffer.free_after is not None:
                buffer.free_after.exception()
        self._entries.clear()
        self._buffers.clear()
        self._idle.clear()

    # -- internals ------------------------------------------------------------------------------

    def _allocate(self, nbytes: int) -> _Buffer:
        """A buffer of `nbytes`, making room first: spill the oldest resident entry, or wait for
        the oldest buffer being freed."""
        self._reap()
        while self.used_bytes + nbytes > self.budget_bytes:
            # an entry on its way to the device (`up`) keeps its buffer until `get` frees it
            entries = (
                reversed(self._entries.values()) if self.in_put_order else self._entries.values()
            )
            oldest = next(
                (
                    e
                    for e in entries
                    if e.buffer is not None
                    and e.written is None
                    and e.read is None
                    and e.up is None
                ),
                None,
            )
            freeing = [b for b in self._buffers if b.free_after is not None]
            read_back = [
                e
                for _, e in self._get_order()
                if e.buffer is not None and e.read is not None and e.up is None
            ]
            if oldest is not None:
                self._spill(oldest)
            elif freeing:
                self._wait(freeing[0].free_after)
            elif read_back:  # a prefetched entry, the one needed last: it is on NVMe still
                entry = read_back[-1]
                self._wait(entry.read)
                self._buffers.remove(entry.buffer)
                self._idle.append(entry.buffer.data)
                entry.buffer, entry.read = None, None
            else:
                raise ConfigError(
                    f"the vertical schedule's activation budget ({self.budget_bytes} bytes) cannot "
                    f"hold one activation of {nbytes} bytes; raise --activation-budget"
                )
            self._reap()
        return self._take(nbytes)

    def _get_order(self) -> list[tuple[tuple[int, int], _Entry]]:
        """The entries in the order `get` takes them (backward: units descending, micro-batches in
        order)."""
        return sorted(self._entries.items(), key=self._order)

    def _take(self, nbytes: int) -> _Buffer:
        """A buffer of at least `nbytes` (room for it made): the smallest freed one that fits
        the budget, else a new one, dropping freed ones first so that everything held fits."""
        fits = [
            i
            for i, d in enumerate(self._idle)
            if nbytes <= d.numel() <= self.budget_bytes - self.used_bytes
        ]
        if fits:
            data = self._idle.pop(min(fits, key=lambda i: self._idle[i].numel()))
        else:
            while (
                self._idle
                and self.used_bytes + sum(d.numel() for d in self._idle) + nbytes
                > self.budget_bytes
            ):
                self._idle.pop(0)
            # pinned pages of exactly this size, never from torch's caching host allocator (which
            # rounds up to a power of two and never unpins); page-aligned either way: direct I/O
            data = (
                pinned_empty(nbytes, self.tiers.streams.device)
                if self.tiers.streams.separate
                else aligned_empty(nbytes, torch.uint8)
            )
        buffer = _Buffer(data)
        self._buffers.append(buffer)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return buffer

    def _spill(self, entry: _Entry) -> None:
        unit, micro = next(k for k, e in self._entries.items() if e is entry)
        store = self._nvme()
        raw, buffer, entry.buffer = entry.raw(), entry.buffer, None
        entry.written = buffer.free_after = self.tiers.submit(
            _write_when_landed(self.tiers, entry.landed, store, self._key(unit, micro), raw)
        )
        entry.landed = None
        self.spilled += 1
        self.tiers.stats.add_bytes(Link.HOST_TO_NVME, entry.nbytes)

    def _read(self, unit: int, micro: int, entry: _Entry) -> None:
        entry.read = self.tiers.submit(self._nvme().read_into(self._key(unit, micro), entry.raw()))
        self.tiers.stats.add_bytes(Link.NVME_TO_HOST, entry.nbytes)

    def _nvme(self) -> TierStore:
        store = self.tiers.stores.get(Tier.NVME)
        if store is None:
            raise ConfigError(
                f"the vertical schedule's waiting activations overflow their host budget "
                f"({self.budget_bytes} bytes) and no state lives on nvme to spill them to; "
                "raise --activation-budget or --host-budget, or use --schedule horizontal"
            )
        return store

    def _key(self, unit: int, micro: int) -> str:
        return f"{self.name}/u{unit:04d}/m{micro:04d}"

    def _wait(self, future: concurrent.futures.Future | None) -> None:
        if future is not None:
            with self.tiers.stats.waiting():
                future.result()  # sync point: an NVMe write or read of an activation

    def _reap(self) -> None:
        """Drop the buffers whose write or copy has happened (raising a failed write's error)."""
        live = []
        for buffer in self._buffers:
            if buffer.free_after is not None and buffer.free_after.done():
                buffer.free_after.result()
                self._idle.append(buffer.data)
            else:
                live.append(buffer)
        self._buffers = live


def _backward_key(item: tuple[tuple[int, int], _Entry]) -> tuple[int, int]:
    """An entry's place in backward order: units descending, micro-batches in order."""
    (unit, micro), _ = item
    return -unit, micro


def aligned_nbytes(nbytes: int) -> int:
    """`nbytes` rounded up to direct I/O's alignment: what an entry of `nbytes` holds."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _put_key(item: tuple[tuple[int, int], _Entry]) -> tuple[int, int]:
    """An entry's place in put order (an evaluation pass): units ascending, micro-batches in
    order."""
    return item[0]


async def _write_when_landed(
    tiers: Tiers, landed: Event, store: TierStore, key: str, data: torch.Tensor
) -> None:
    """Spill an activation to NVMe once its copy into the host buffer `data` has happened."""
    await tiers.landed(landed)
    await store.write(key, data)
