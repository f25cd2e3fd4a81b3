"""Gradient shards: reduce, unscale, accumulate in their home tier, and measure.

A unit's flat gradient arrives from backward in the compute dtype, with the slots that got one
(`present`: the others are zeros, and the optimizer skips them as torch's AdamW skips a parameter
whose grad is None). It becomes fp32, is reduce-scattered to this rank's shard (its trainable
prefix: frozen parameters have no grad) and unscaled (fp16); later micro-batches of the step add
what the earlier ones stored, piece by piece (a resident buffer for `gpu`/`host`, a staged read for
`nvme`, issued a unit ahead in the order micro-batch 0 accumulated the units, so autograd's thread
finds the earlier sum landed instead of reading it). On the last micro-batch the accumulated shard's
norms and its finiteness are recorded, so clipping and overflow checks need no second pass, and with
overlap_step the shard goes straight to the optimizer; otherwise each piece is stored in its home.

The grad home holds the planned grad dtype (`planning.statebytes.grad_dtype`): fp32 wherever
micro-batches are added into it; with bf16 compute and nothing to add (one micro-batch per
step, or the vertical schedule's sums) bf16. The final fp32 shard is then rounded to the
nearest bf16 in place on the device, so what is measured, stepped in place and sent off the
device (cast in the copy, exactly: half the bytes) is one value.

Pieces leave the device on the d2h stream (`tierzero.engine.runtime.streams`), each copy waiting for
the compute event that finished its shard; nothing in backward waits for the device. Host code reads
a host-homed piece only after its copy's event (`settle`), an nvme write is issued by an I/O thread
after it, and earlier micro-batches' sums come back on the h2d_write stream.

With several ranks and `overlap`, a unit's reduce-scatter is started when its backward ends
and finished when the next unit's does (`offload` of the next, or `flush` at the end of
backward), so it runs while that unit's backward computes.

ZeRO stage 1 (`full_until_last`, several ranks): the micro-batches before the last add each
unit's whole flat gradient into `grad_full` pieces in the grad home, with no communication;
the last adds that sum to its own and reduce-scatters it once, so a step costs one
reduction per unit use whatever `accumulate` is. A reduce-scatter rather than an all-reduce:
each rank steps only its shard, so it needs only its shard of the sum (half the bytes).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator

import torch

from tierzero.config import StateKind, Tier
from tierzero.distributed.comm import InFlight
from tierzero.engine.runtime.layout import RankLayout
from tierzero.engine.runtime.streams import Event
from tierzero.engine.runtime.tiers import Tiers
from tierzero.engine.step.backward import BackwardPass
from tierzero.engine.step.gradio import read_after_write, write_when_landed
from tierzero.engine.step.gradnorms import GradNorms
from tierzero.errors import TierzeroError
from tierzero.layout.keys import state_keys
from tierzero.layout.partition import Unit, grad_uses, piece_ranges
from tierzero.planning.placement import Link
from tierzero.storage.base import BudgetExceededError


class GradShards:
    def __init__(
        self, layout: RankLayout, tiers: Tiers, norms: GradNorms, overlap_comm: bool
    ) -> None:
        """`norms`: what each micro-batch's final shards are measured for; `overlap_comm`:
        several ranks reduce a unit beside the next one's backward."""
        self.layout, self.transfers = layout, tiers.stats
        self.tiers, self.home, self.comm = tiers, layout.placement.grad, layout.comm
        # contributions per unit per backward (a tied embedding gets two)
        self.uses = grad_uses(layout.units)
        self.seen: dict[int, int] = {}  # contributions so far in this backward
        self.dtype = layout.grad_dtype  # what the home stores; only fp32 is ever added to
        self.present: dict[int, set[int]] = {}  # unit -> its slots that got a grad in this step
        self.pass_ = BackwardPass()  # the backward in progress (`running`)
        self.measured = norms  # the last micro-batch's norms and finiteness
        several = layout.comm.world_size > 1
        self.overlap = overlap_comm and several
        self._reducing: tuple[int, InFlight] | None = None
        self.full_until_last = layout.stage == 1 and several  # stage 1: see the module docstring
        self._full_held: set[int] = (
            set()
        )  # units whose `grad_full` pieces hold this step's earlier sum
        self._writes: dict[
            str, concurrent.futures.Future
        ] = {}  # piece key -> its grad write in flight
        self._landing: dict[str, Event] = {}  # host-homed piece key -> its D2H copy's event
        self._stashed: dict[
            int, tuple[torch.Tensor, Event]
        ] = {}  # a tied unit's earlier uses' sum on the host, its D2H
        self._held: dict[
            int, torch.Tensor
        ] = {}  # grad home on the device: unit -> its earlier uses' sum
        self._order: list[int] = []  # units in the order micro-batch 0 accumulated them
        self._ahead: dict[
            str, tuple[concurrent.futures.Future, torch.Tensor]
        ] = {}  # nvme key -> read, stage
        self.streams = tiers.streams

    @contextlib.contextmanager
    def running(self, pass_: BackwardPass) -> Iterator[None]:
        """Accumulate the grads of the backward `pass_` (which micro-batch, whether it ends the
        step, the 1/scale, what `gathered` blocks add, whether units are stepped at once)."""
        self.pass_ = pass_
        self.seen = {}
        if pass_.micro == 0:
            self._order = []
            self._full_held.clear()
            self.present = {}
            self.measured.reset()
        elif self._order:
            self._read_ahead(self._order[0])
        try:
            yield
        finally:
            self._drop_ahead()
            self.pass_ = BackwardPass()  # drops the pass's tensors and its optimizer
            for unit in list(self._held):  # a backward that failed between a tied unit's uses
                self._give_back_held(unit)
            self._drop_stashed()

    def offload(self, unit: int, full_grad: torch.Tensor, present: frozenset[int]) -> None:
        """Start reducing one unit's gradient over the ranks; with `overlap`, accumulate the
        previous unit's, whose reduction ran while this unit's backward computed (the last
        one's at `flush`)."""
        u = self.layout.units[unit]
        extra = self.pass_.extra.pop(unit, None)
        if (
            extra is not None
        ):  # unit + regulariser: the two terms autograd sums for a weight used twice
            full_grad = full_grad.float() + extra[0].to(full_grad.device)
            present = present | extra[1]
        if self.comm.world_size > 1:  # ranks must agree on what is stepped: every trainable slot
            present = frozenset(i for i, slot in enumerate(u.slots) if not slot.frozen)
        self.present.setdefault(unit, set()).update(present)
        full_grad = full_grad.float()
        if self.full_until_last:
            keys = self.full_keys(u)
            if (
                unit in self._full_held
            ):  # the earlier micro-batches' (and uses') sum, piece by piece
                self._full_held.discard(unit)
                for key, a, b in keys:
                    self._add_previous(key, full_grad[a:b])
            if not self.pass_.last:  # kept whole until the last micro-batch: no communication
                produced = self.streams.record(self.streams.compute)
                for key, a, b in keys:
                    self._store(key, full_grad[a:b], produced)
                self._full_held.add(unit)
                return
        reducing = self.comm.reduce_scatter_async(full_grad)
        self.flush()
        self._reducing = (unit, reducing)
        if not self.overlap:
            self.flush()

    def flush(self) -> None:
        """Accumulate the gradient still being reduced: at the end of backward, and before the
        next unit's is started."""
        if self._reducing is None:
            return
        (unit, reducing), self._reducing = self._reducing, None
        with self.transfers.waiting():
            shard = reducing.wait()  # sync point: the host on gloo, the compute stream on NCCL
        self._accumulate(unit, shard)

    def discard(self) -> None:
        """Drop a reduction in flight (a backward that failed): let it finish, keep nothing."""
        if self._reducing is not None:
            (_, reducing), self._reducing = self._reducing, None
            try:
                reducing.wait()
            except TierzeroError:
                pass  # a lost rank: the caller's error already stops the step

    def _accumulate(self, unit: int, shard: torch.Tensor) -> None:
        """Accumulate one unit's reduced shard into its home (and measure it on the last
        micro-batch)."""
        u = self.layout.units[unit]
        self.seen[unit] = self.seen.get(unit, 0) + 1
        grad = shard[: u.state_numel(self.comm.rank)]
        if self.pass_.inv_scale != 1.0:
            grad = grad * self.pass_.inv_scale
        if self.uses[unit] > 1 and not self.pass_.combined:
            # A unit used twice per pass (a tied embedding): autograd adds a weight's uses
            # first and then accumulates, so hold the earlier uses' sum in the grad's home
            # until the last use; adding each to the accumulator would round differently.
            grad = self._combine_uses(unit, grad)
            if grad is None:
                return
        keys = state_keys(StateKind.GRAD, u, self.comm.rank, self.layout.piece_numel, self.home)
        # earlier micro-batches' sum, piece by piece (prev + new: addition commutes); stage 1
        # summed them before the reduction
        assert self.pass_.last or self.dtype == torch.float32, "only fp32 grads are added to"
        if self.pass_.micro == 0:
            self._order.append(unit)
        elif not self.full_until_last:
            at = self._order.index(unit) if unit in self._order else -1
            if 0 <= at < len(self._order) - 1:
                self._read_ahead(
                    self._order[at + 1]
                )  # beside this add and the next unit's backward
            for key, a, b in keys:
                self._add_previous(key, grad[a:b])
        if self.dtype != torch.float32:  # rounded in place, a piece at a time (a piece's temporary)
            for _, a, b in keys:
                grad[a:b].copy_(grad[a:b].to(self.dtype))
        if self.pass_.last:
            self.measured.measure(u, grad, self.present[unit])
            if self.pass_.step is not None:
                self.pass_.step.grad_ready(
                    u, grad
                )  # the optimizer steps it piece by piece, never stored
                return
        produced = self.streams.record(self.streams.compute)  # the shard is final on compute
        for key, a, b in keys:
            self._store(key, grad[a:b], produced)

    def full_keys(self, unit: Unit) -> list[tuple[str, int, int]]:
        """Stage 1: this rank's pieces of `unit`'s whole trainable gradient (flat offsets)."""
        return [
            (f"grad_full/u{unit.index:04d}/r{self.comm.rank}/p{i:04d}", a, b)
            for i, (a, b) in enumerate(piece_ranges(unit.trainable_numel, self.layout.piece_numel))
        ]

    def allocate(self) -> None:
        """Stage 1 with the grad home in memory: make room for the whole gradients there."""
        if self.full_until_last and self.home is not Tier.NVME:
            store = self.tiers.stores[self.home]
            for unit in self.layout.units:
                for key, a, b in self.full_keys(unit):
                    self.tiers.run(store.write(key, torch.zeros(b - a, dtype=torch.float32)))

    def settle(self) -> None:
        """Wait until every grad piece copied to the host has landed: before host code reads
        the grad home (the optimizer step, a checkpoint). Waits on D2H events only."""
        for event in self._landing.values():
            self.streams.host_wait(event)
        self._landing.clear()

    def _add_previous(self, key: str, part: torch.Tensor) -> None:
        store = self.tiers.stores[self.home]
        if self.home is Tier.GPU:
            part.add_(store.view(key))
            return
        if self.home is Tier.HOST:
            # to the device on the h2d_write stream, after the last micro-batch's D2H of this piece
            self._add_from_host(
                part, store.view(key), after=self._landing.pop(key, None), stage=None
            )
            return
        ahead = self._ahead.pop(key, None)
        if ahead is None:
            ahead = self._issue_read(
                key, self.tiers.lease_host(part.numel() * 4).view(torch.float32)
            )
        read, stage = ahead
        try:
            with self.transfers.waiting():
                read.result()  # issued a unit ahead: normally landed already
        except BaseException:
            self.tiers.host_pool.give_back(stage.view(torch.uint8))
            raise
        self.transfers.add_bytes(Link.NVME_TO_HOST, part.numel() * 4)
        self._add_from_host(part, stage, after=None, stage=stage)

    def _read_ahead(self, unit: int) -> None:
        """Start reading `unit`'s earlier micro-batches' grad pieces from nvme into leased host
        buffers, as far as the pool has room without waiting (what it has not is read when
        needed)."""
        if self.home is not Tier.NVME or self.pass_.micro == 0:
            return
        for key, a, b in state_keys(
            StateKind.GRAD,
            self.layout.units[unit],
            self.comm.rank,
            self.layout.piece_numel,
            self.home,
        ):
            if key in self._ahead:
                continue
            try:
                stage = self.tiers.lease_host((b - a) * 4, wait=False).view(torch.float32)
            except BudgetExceededError:
                return
            self._ahead[key] = self._issue_read(key, stage)

    def _issue_read(
        self, key: str, stage: torch.Tensor
    ) -> tuple[concurrent.futures.Future, torch.Tensor]:
        """Read a grad piece into `stage` on an I/O thread, after its last write has landed."""
        return self.tiers.submit(
            read_after_write(self._writes.pop(key, None), self.tiers.stores[Tier.NVME], key, stage)
        ), stage

    def _drop_ahead(self) -> None:
        """Give back the read-ahead buffers a pass did not use (a failed or re-run backward)."""
        for read, stage in self._ahead.values():
            self.tiers.pending.add(
                read,
                lambda ok, stage=stage: self.tiers.host_pool.give_back(stage.view(torch.uint8)),
            )
        self._ahead.clear()

    def _add_from_host(
        self, part: torch.Tensor, host: torch.Tensor, after: Event, stage: torch.Tensor | None
    ) -> Event:
        """`part += host` on the compute device: `host` goes over on the h2d_write stream (after
        `after`), compute waits for that copy; a leased `stage` goes back once it is done. The
        copy's event: `host` may be reused after it."""
        s = self.streams
        # on the write stream, never behind (or ahead of) the param fetches on `h2d`
        prev = s.empty_like(
            part, s.h2d_write
        )  # never memory that compute's queued kernels still read
        copied = s.copy(prev, host, s.h2d_write, after=after)
        s.keep_alive(prev, s.compute)
        s.wait(s.compute, copied)
        self.transfers.add_bytes(Link.HOST_TO_GPU, part.numel() * 4)
        part.add_(prev)
        if stage is not None:
            self.tiers.give_back_when_done(copied, stage)
        return copied

    def _store(self, key: str, part: torch.Tensor, produced: Event) -> None:
        """Put a final piece in its home: D2H on the d2h stream once compute has produced it;
        host code waits for `_landing[key]`, an nvme write for the copy's event (I/O thread)."""
        nbytes = part.numel() * self.dtype.itemsize  # cast in the copy where the home is not fp32
        s = self.streams
        if self.home is Tier.GPU:
            self.tiers.stores[Tier.GPU].view(key).copy_(part)
            return
        if self.home is Tier.HOST:
            self._landing[key] = s.copy(
                self.tiers.stores[Tier.HOST].view(key), part, s.d2h, after=produced
            )
            s.keep_alive(part, s.d2h)
            self.transfers.add_bytes(Link.GPU_TO_HOST, nbytes)
            return
        stage = self.tiers.lease_host(nbytes).view(self.dtype)
        landed = s.copy(stage, part, s.d2h, after=produced)
        s.keep_alive(part, s.d2h)
        self.transfers.add_bytes(Link.GPU_TO_HOST, nbytes)
        future = self._writes[key] = self.tiers.submit(
            write_when_landed(self.tiers, landed, self.tiers.stores[Tier.NVME], key, stage)
        )
        self.tiers.pending.add(
            future, lambda ok: self.tiers.host_pool.give_back(stage.view(torch.uint8))
        )
        self.transfers.add_bytes(Link.HOST_TO_NVME, nbytes)

    def _combine_uses(self, unit: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Stash this use's grad (plus earlier ones) in a host buffer; at the unit's last use
        of the pass return the sum of all of them (None before that).

        Each use adds the earlier uses' stash on the compute device (it comes back on the
        h2d_write stream once its D2H copy has landed: sums commute bitwise); a use before the
        last sends the sum to the host on the d2h stream, where it stays in its leased buffer
        (the memory model counts it through backward): no trip through the grad home and no
        host wait on autograd's thread. With the grad home on the device the stash never leaves
        it (`_combine_on_device`)."""
        if self.home is Tier.GPU:
            return self._combine_on_device(unit, grad)
        held = self._stashed.pop(unit, None)
        if held is not None:
            stash, landed = held
            self._add_from_host(grad, stash, after=landed, stage=stash)
        if self.seen[unit] == self.uses[unit]:
            assert held is not None, f"unit {unit}'s earlier uses left no stash"
            return grad
        s, nbytes = self.streams, grad.numel() * 4
        stage = self.tiers.lease_host(nbytes).view(torch.float32)
        self._stashed[unit] = stage, s.copy(stage, grad, s.d2h, after=s.record(s.compute))
        s.keep_alive(grad, s.d2h)
        self.transfers.add_bytes(Link.GPU_TO_HOST, nbytes)
        return None

    def _drop_stashed(self) -> None:
        """Give back the host stashes a failed backward left, once their copies have landed."""
        for stash, landed in self._stashed.values():
            self.tiers.give_back_when_done(landed, stash)
        self._stashed.clear()

    def _combine_on_device(self, unit: int, grad: torch.Tensor) -> torch.Tensor | None:
        """`_combine_uses` with the grad home on the device: the earlier uses' sum is held in a
        device pool buffer and summed on the compute stream -- no PCIe trip and no host wait,
        where a store round trip would cost four trips and a sync per use."""
        s = self.streams
        held = self._held.get(unit)
        if self.seen[unit] < self.uses[unit]:
            if held is None:
                buf = self.tiers.lease_device(grad.numel() * 4)
                s.wait(
                    s.compute, self.tiers.device_pool.take_ready(buf)
                )  # its last holder's release
                self._held[unit] = buf.view(torch.float32).copy_(grad)
            else:
                held.add_(grad)  # earlier + this use: addition commutes bitwise
            return None
        assert held is not None, f"unit {unit}'s earlier uses left no stash"
        grad.add_(held)
        self._give_back_held(unit)
        return grad

    def _give_back_held(self, unit: int) -> None:
        held = self._held.pop(unit)
        s = self.streams
        self.tiers.device_pool.give_back(held.view(torch.uint8), ready=s.record(s.compute))
