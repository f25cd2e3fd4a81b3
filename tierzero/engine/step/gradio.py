"""The I/O threads' half of grad accumulation: coroutines that move grad pieces between the
host and nvme once the copy or write they depend on has finished (`tierzero.engine.step.grads`)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import torch

from tierzero.engine.runtime.streams import Event
from tierzero.engine.runtime.tiers import Tiers
from tierzero.storage.base import TierStore


async def write_when_landed(
    tiers: Tiers, landed: Event, store: TierStore, key: str, stage: torch.Tensor
) -> None:
    """Write a grad piece to nvme once its D2H copy into `stage` has happened."""
    await tiers.landed(landed)
    await store.write(key, stage)


async def read_after_write(
    write: concurrent.futures.Future | None, store: TierStore, key: str, stage: torch.Tensor
) -> None:
    """Read a grad piece once the write that stored it (the previous micro-batch's) has finished."""
    if write is not None:
        await asyncio.wrap_future(write)
    await store.read_into(key, stage)
