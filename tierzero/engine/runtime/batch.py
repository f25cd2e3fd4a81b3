"""`BatchStaging`: how a micro-batch reaches the compute device without a host sync.

A `.to(device)` from pageable memory makes the host wait for the copy (the driver stages it),
once per micro-batch. Here each tensor of a batch is copied on the host into a pinned buffer
kept from the previous micro-batch (reallocated only when its shape or dtype changes), then
into device memory allocated for the activations' stream (`Streams.h2d_act`: never behind
param fetches that wait for buffer releases) by a non-blocking copy on that stream; the
compute stream waits for the copy's event before the forward reads it, and `keep_alive` keeps
the allocator from reusing that memory before compute is done with it. Before overwriting the
staging buffers the host waits for the previous micro-batch's copies out of them: events
long past by then, never the compute stream. On the CPU device (one memory) nothing moves.
"""

from __future__ import annotations

from typing import Any

import torch

from tierzero.engine.runtime.streams import Event, Streams
from tierzero.reference import to_device


class BatchStaging:
    """Pinned staging buffers for the batch's tensors, in the order the batch lists them."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self._staging: list[torch.Tensor] = []
        self._templates: dict[
            torch.dtype, torch.Tensor
        ] = {}  # one element on the device, per dtype
        self._copied: Event = None  # the previous micro-batch's copies out of `_staging`
        self._next = 0

    def to_device(self, batch: Any) -> Any:
        """`batch` (a tensor, dict, tuple or list of them) with its host tensors on the device."""
        s = self.streams
        if not s.separate:
            return to_device(batch, s.device)
        s.host_wait(self._copied)  # an h2d event: the staging buffers are about to be overwritten
        self._next = 0
        moved = self._move(batch)
        self._copied = s.record(s.h2d_act)
        return moved

    def _move(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (
                self._copy(value) if value.device.type == "cpu" else value.to(self.streams.device)
            )
        if isinstance(value, dict):
            return {k: self._move(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(self._move(v) for v in value)
        return value

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        s = self.streams
        staging = self._staging_for(tensor)
        staging.copy_(tensor)  # host memory to host memory: no device involved
        if tensor.dtype not in self._templates:
            self._templates[tensor.dtype] = torch.empty((), dtype=tensor.dtype, device=s.device)
        # an expanded one-element tensor's `empty_like` is contiguous memory of the batch's shape
        out = s.empty_like(self._templates[tensor.dtype].expand(tensor.shape), s.h2d_act)
        s.wait(s.compute, s.copy(out, staging, s.h2d_act))
        s.keep_alive(out, s.compute)
        return out

    def _staging_for(self, tensor: torch.Tensor) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        if (
            i < len(self._staging)
            and self._staging[i].shape == tensor.shape
            and self._staging[i].dtype == tensor.dtype
        ):
            return self._staging[i]
        buf = torch.empty(
            tensor.shape, dtype=tensor.dtype, pin_memory=self.streams.device.type == "cuda"
        )
        self._staging[i : i + 1] = [buf]
        return buf
