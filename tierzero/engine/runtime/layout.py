"""`RankLayout`: what this rank holds and how it is laid out -- the one record the parts that
move, reduce or step a shard (the swap runner, the grad shards, the optimizer, the param sync)
receive besides the tiers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierzero.config import Placement
from tierzero.distributed.comm import Comm
from tierzero.layout.partition import Unit


@dataclass(frozen=True)
class RankLayout:
    """What this rank holds and how it is laid out: its units, each state kind's home tier,
    the ZeRO stage, the piece size grads and optimizer states stream in, the dtypes params
    and grads are stored in, and the collectives over the ranks. The parts that move, reduce
    or step a shard read these, and nothing else of the engine."""

    units: list[Unit]
    placement: Placement
    stage: int
    piece_numel: int
    dtype: torch.dtype  # the compute dtype params are stored in
    grad_dtype: torch.dtype  # what grads leave the device in and rest in (`Sizing.grad_dtype`)
    comm: Comm

    @property
    def rank(self) -> int:
        return self.comm.rank
