"""Gradient shards: reduce, unscale, accumulate in fp32 in their home tier, and measure.

A unit's flat gradient arrives from backward in the compute dtype, with the slots that got
one (`present`: the others are zeros, and the optimizer skips them as torch's AdamW skips a
parameter whose grad is None). It becomes fp32, is reduce-scattered to this rank's shard
(its trainable prefix: frozen parameters have no grad) and unscaled (fp16); later
micro-batches of the step add what the earlier ones stored, piece by piece (a resident buffer for `gpu`/`host`, a staged read for
`nvme`). On the last micro-batch the accumulated shard's norms and its finiteness are
recorded, so clipping and overflow checks need no second pass, and with overlap_step the
shard goes straight to the optimizer; otherwise each piece is stored in its home.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch

from tierzero.comm import Comm
from tierzero.config import StateKind, Tier
from tierzero.partition import Unit
from tierzero.stats import StepStats
from tierzero.tiers import Tiers, state_keys


class GradShards:
    def __init__(self, units: list[Unit], tiers: Tiers, home: Tier, comm: Comm, stats: StepStats,
                 uses: dict[int, int], piece_numel: int, norms: bool, finite: bool) -> None:
        self.units = units
        self.tiers = tiers
        self.home = home
        self.comm = comm
        self.stats = stats
        self.uses = uses  # contributions per unit per backward (a tied embedding gets two)
        self.piece_numel = piece_numel
        self.seen: dict[int, int] = {}  # contributions so far in this backward
        self.present: dict[int, set[int]] = {}  # unit -> its slots that got a grad in this step
        self.stored: set[int] = set()  # units whose grad is in their home (added to from then on)
        self.handed: set[int] = set()  # units handed to the optimizer in this step (overlap_step)
        self.want_norms = norms  # clipping needs them
        self.want_finite = finite  # fp16 needs the overflow check
        self.micro = 0
        self.last = True
        self.inv_scale = 1.0
        self.norms: dict[str, torch.Tensor] = {}  # param name -> 2-norm (one rank) of its grad
        self.sumsq = torch.zeros((), dtype=torch.float32)  # several ranks: this shard's sum of squares
        self.nonfinite = torch.zeros((), dtype=torch.bool)
        # overlap_step: on the last micro-batch the optimizer takes each finished shard at once
        self.hand_over: Callable[[Unit, torch.Tensor], None] | None = None
        # gradients of this backward that reached `Engine.gathered` copies, by unit: added to the
        # unit's own at its first contribution (`tierzero.gathered`)
        self.extra: dict[int, tuple[torch.Tensor, frozenset[int]]] = {}
        self._writes: dict[str, concurrent.futures.Future] = {}  # piece key -> its grad write in flight

    def begin(self, micro: int, last: bool, inv_scale: float) -> None:
        """Before a backward: which micro-batch it is, whether it ends the step, the 1/scale."""
        self.micro, self.last, self.inv_scale = micro, last, inv_scale
        self.seen = {}
        if micro == 0:
            self.present, self.stored, self.handed = {}, set(), set()
            self.norms.clear()
            self.sumsq = torch.zeros((), dtype=torch.float32)
            self.nonfinite = torch.zeros((), dtype=torch.bool)

    def offload(self, unit: int, full_grad: torch.Tensor, present: frozenset[int]) -> None:
        """Accumulate one unit's gradient into its home (and measure it on the last micro-batch)."""
        u = self.units[unit]
        self.seen[unit] = self.seen.get(unit, 0) + 1
        extra = self.extra.pop(unit, None)
        if extra is not None:  # unit + regulariser: the two terms autograd sums for a weight used twice
            full_grad = full_grad.float() + extra[0].to(full_grad.device)
            present = present | extra[1]
        if self.comm.world_size > 1:  # ranks must agree on what is stepped: every trainable slot
            present = frozenset(i for i, slot in enumerate(u.slots) if not slot.frozen)
        self.present.setdefault(unit, set()).update(present)
        grad = self.comm.reduce_scatter(full_grad.float())[:u.state_numel(self.comm.rank)]
        if self.inv_scale != 1.0:
            grad = grad * self.inv_scale
        if self.uses[unit] > 1:
            # A unit used twice per pass (a tied embedding): autograd adds a weight's uses
            # first and then accumulates, so hold the earlier uses' sum in the grad's home
            # until the last use; adding each to the accumulator would round differently.
            grad = self._combine_uses(unit, grad)
            if grad is None:
                return
        final = self.last
        keys = state_keys(StateKind.GRAD, u, self.comm.rank, self.piece_numel, self.home)
        if unit in self.stored:  # earlier micro-batches' sum, piece by piece (prev + new: addition commutes)
            for key, a, b in keys:
                self._add_previous(key, grad[a:b])
        if final:
            self._measure(u, grad)
            if self.hand_over is not None:
                self.handed.add(unit)
                self.hand_over(u, grad)  # the optimizer steps it piece by piece, never stored
                return
        for key, a, b in keys:
            self._store(key, grad[a:b])
        self.stored.add(unit)

    def take_extra(self) -> dict[int, tuple[torch.Tensor, frozenset[int]]]:
        """The gathered copies' gradients no unit's backward has taken (units it never reached)."""
        extra, self.extra = self.extra, {}
        return extra

    def _add_previous(self, key: str, part: torch.Tensor) -> None:
        store = self.tiers.stores[self.home]
        if self.home is not Tier.NVME:
            part.add_(store.view(key).to(part.device))
            return
        stage = self.tiers.lease_host(part.numel() * 4).view(torch.float32)
        try:
            with self.stats.waiting():
                write = self._writes.pop(key, None)
                if write is not None:
                    write.result()  # read after write: the last micro-batch's must land
                self.tiers.run(store.read_into(key, stage))
            self.stats.add_bytes("nvme->host", part.numel() * 4)
            part.add_(stage.to(part.device))
        finally:
            self.tiers.host_pool.give_back(stage.view(torch.uint8))

    def _store(self, key: str, part: torch.Tensor) -> None:
        nbytes = part.numel() * 4
        streams = self.tiers.streams
        if self.home is not Tier.NVME:
            streams.copy(self.tiers.stores[self.home].view(key), part, streams.compute)
            streams.host_wait(streams.record(streams.compute))  # sync point: the grad is on the host
            if self.home is Tier.HOST:
                self.stats.add_bytes("gpu->host", nbytes)
            return
        stage = self.tiers.lease_host(nbytes).view(torch.float32)
        streams.copy(stage, part, streams.compute)
        streams.host_wait(streams.record(streams.compute))  # sync point: the device grad lands in host memory
        future = self._writes[key] = self.tiers.submit(self.tiers.stores[Tier.NVME].write(key, stage))
        self.tiers.pending.add(future, lambda ok: self.tiers.host_pool.give_back(stage.view(torch.uint8)))
        self.stats.add_bytes("host->nvme", nbytes)

    def _combine_uses(self, unit: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Stash this use's grad (plus earlier ones) in the home tier; at the unit's last use
        of the pass return the sum of all of them (None before that)."""
        store = self.tiers.stores[self.home]
        key = f"grad_uses/u{unit:04d}/r{self.comm.rank}"
        nbytes = grad.numel() * 4
        stage = self.tiers.lease_host(nbytes).view(torch.float32)
        try:
            if self.seen[unit] > 1:
                with self.stats.waiting():
                    self.tiers.run(store.read_into(key, stage))
                self._count(f"{self.home.value}->host", nbytes)
                stage.add_(grad.to(stage.device))
            else:
                stage.copy_(grad)
            if self.seen[unit] < self.uses[unit]:
                self.tiers.run(store.write(key, stage))
                self._count(f"host->{self.home.value}", nbytes)
                return None
            self.tiers.run(store.delete(key))
            return stage.to(grad.device, copy=True)
        finally:
            self.tiers.host_pool.give_back(stage.view(torch.uint8))

    def _count(self, link: str, nbytes: int) -> None:
        if self.home is Tier.NVME:  # memory homes: a copy within the tier, not a link
            self.stats.add_bytes(link, nbytes)

    def _measure(self, unit: Unit, acc: torch.Tensor) -> None:
        """Only what the step will ask for: each costs a pass over the shard."""
        if self.want_finite:
            self.nonfinite |= ~torch.isfinite(acc).all().cpu()
        if not self.want_norms:
            return
        if self.comm.world_size == 1:
            # per-parameter norms, combined later in the model's parameter order, exactly as
            # torch.nn.utils.clip_grad_norm_ does it, so clipping stays bitwise comparable
            # (only parameters with a grad: `clip_grad_norm_` leaves out those whose grad is None)
            for i, slot in enumerate(unit.slots):
                if i in self.present[unit.index]:
                    self.norms[slot.names[0]] = torch.linalg.vector_norm(acc[slot.offset:slot.end], 2.0).cpu()
        else:
            self.sumsq += acc.double().pow(2).sum().float().cpu()

    def found_inf(self) -> bool:
        """Whether any accumulated grad of the step is inf/NaN (one host-device sync)."""
        flag = self.comm.all_reduce_sum(self.nonfinite.to(torch.float32))
        return bool(flag.item() > 0)

    def total_norm(self, param_order: list[str]) -> torch.Tensor:
        """The global 2-norm (fp32 tensor), combined as `clip_grad_norm_` combines it."""
        if self.comm.world_size == 1:
            norms = [self.norms[n] for n in param_order if n in self.norms]
            return torch.linalg.vector_norm(torch.stack(norms), 2.0)
        return self.comm.all_reduce_sum(self.sumsq.clone()).sqrt()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_`'s factor, computed the same way (fp32 tensor arithmetic, clamped to 1)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
