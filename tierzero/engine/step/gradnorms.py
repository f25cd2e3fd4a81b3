"""`GradNorms`: what the step asks of the accumulated grads -- their 2-norm for clipping and,
with fp16, whether any is inf/NaN -- measured on the last micro-batch as each unit's shard
is final (`tierzero.engine.step.grads`), so neither needs a second pass over the grads.

Measured on the compute device and read on the host only when the step needs them: one
host-device sync per step, not one per unit or parameter in backward.
"""

from __future__ import annotations

import torch

from tierzero.distributed.comm import Comm
from tierzero.layout.partition import Unit, piece_ranges


class GradNorms:
    def __init__(
        self, comm: Comm, piece_numel: int, device: torch.device, clips: bool, fp16: bool
    ) -> None:
        """Norms are measured only where the step `clips`, finiteness only where it is `fp16`
        (the loss scaler's overflow check)."""
        self.comm, self.piece_numel, self.device = comm, piece_numel, device
        self.want_norms = clips
        self.want_finite = fp16
        self.norms: dict[
            str, torch.Tensor
        ] = {}  # param name -> 2-norm (one rank) of its grad, on the device
        self.reset()

    def reset(self) -> None:
        """Forget the last step's measures (a step's first micro-batch)."""
        self.norms.clear()
        self.sumsq = torch.zeros(
            (), dtype=torch.float32, device=self.device
        )  # several ranks: this shard's
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)

    def measure(self, unit: Unit, acc: torch.Tensor, present: set[int]) -> None:
        """Only what the step will ask for of `unit`'s final shard `acc` (its slots `present`
        got a grad): each costs a pass over the shard."""
        if self.want_finite:
            self.nonfinite |= ~torch.isfinite(acc).all()
        if not self.want_norms:
            return
        if self.comm.world_size == 1:
            # per-parameter norms, combined later in the model's parameter order, exactly as
            # torch.nn.utils.clip_grad_norm_ does it, so clipping stays bitwise comparable
            # (only parameters with a grad: `clip_grad_norm_` leaves out those whose grad is None)
            for i, slot in enumerate(unit.slots):
                if i in present:
                    self.norms[slot.names[0]] = torch.linalg.vector_norm(
                        acc[slot.offset : slot.end], 2.0
                    )
        else:  # in fp64 a piece at a time: no fp64 copy of the whole shard
            sumsq = torch.zeros((), dtype=torch.float64, device=acc.device)
            for a, b in piece_ranges(acc.numel(), self.piece_numel):
                sumsq += acc[a:b].double().pow(2).sum()
            self.sumsq += sumsq.float()

    def found_inf(self) -> bool:
        """Whether any accumulated grad of the step is inf/NaN (one host-device sync)."""
        flag = self.comm.all_reduce_sum(self.nonfinite.to("cpu", torch.float32))
        return bool(flag.item() > 0)

    def total_norm(self, param_order: list[str]) -> torch.Tensor:
        """The global 2-norm (fp32 tensor), combined as `clip_grad_norm_` combines it."""
        if self.comm.world_size == 1:
            norms = [self.norms[n] for n in param_order if n in self.norms]
            return torch.linalg.vector_norm(torch.stack(norms), 2.0)
        return self.comm.all_reduce_sum(self.sumsq.to("cpu", copy=True)).sqrt()
