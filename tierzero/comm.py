"""Collectives over torch.distributed: all-gather a unit's params, reduce-scatter its grads.

With one rank (no process group) both are views/copies and cost nothing; the engine calls
them the same way either way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives; the old names still work back to torch 2.4
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)  # where NCCL's tensors go: this rank's cuda:k
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The full flat buffer from every rank's shard (one rank: the shard itself)."""
        if self.world_size == 1:
            return shard
        full = torch.empty(shard.numel() * self.world_size, dtype=shard.dtype, device=shard.device)
        _all_gather(full, shard)
        return full

    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the mean over ranks of `full`, as DDP averages gradients
        (one rank: `full` itself)."""
        if self.world_size == 1:
            return full
        shard = torch.empty(full.numel() // self.world_size, dtype=full.dtype, device=full.device)
        _reduce_scatter(shard, full)
        return shard.div_(self.world_size)

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a small (CPU) tensor over ranks; NCCL only reduces GPU tensors, so it travels there."""
        if self.world_size == 1:
            return value
        if dist.get_backend() == "nccl":
            on_gpu = value.to(self.device)
            dist.all_reduce(on_gpu)
            return on_gpu.cpu()
        dist.all_reduce(value)
        return value
