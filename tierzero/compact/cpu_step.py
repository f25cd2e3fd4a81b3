"""The compact step's fast CPU path: numba's kernel loaded, and a piece handed to it.

`load` is the seam: the one function that imports numba (`step.cpu_kernel` calls it once per
process, checks the kernel and falls back to torch's ops where any of it fails).

`step_piece` turns a piece's tensors into the kernel's arrays (zero-copy numpy views: the kernel
writes the stored piece in place) and the step's scalars into fp32 as torch converts a Python
float before a float32 op. Calls take one lock: the kernel already uses every core, and numba's
workqueue threading layer, where it is the one installed, aborts on concurrent calls.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tierzero.compact.formats import StateFormats, split
from tierzero.config import STATE_BLOCK, StateKind

STATES = (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)  # stepped and stored, in order
STREAMS = (StateKind.MASTER, StateKind.EXP_AVG)  # their random bits' streams (the moments share)
PIECE = (*STATES, StateKind.GRAD)  # what the kernel reads, in order
CHUNK = 8192  # values the kernel steps per task (whole blocks): their fp32 copies stay in L2
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
_LOCK = threading.Lock()
_EMPTY = (
    np.empty(0, np.float32),
    np.empty(0, np.uint16),
    np.empty(0, np.uint8),
    np.empty(0, np.float32),
)


def load() -> Callable:
    """Import numba's kernel; numba compiles it, or loads its cached machine code, at the first
    call. Raises whatever numba raises where it is missing."""
    from tierzero.compact import cpu_kernel

    assert cpu_kernel.BLOCK == STATE_BLOCK, (cpu_kernel.BLOCK, STATE_BLOCK)
    return cpu_kernel.run


def installed() -> bool:
    """Whether numba is installed (without importing it): the kernel is then what steps."""
    return importlib.util.find_spec("numba") is not None


def scratch_nbytes() -> int:
    """The most the kernel holds beyond the pieces: each core's chunk arrays (four fp32 and
    three uint32 arrays of `CHUNK`) while it runs."""
    return (os.cpu_count() or 1) * CHUNK * 4 * 7


def usable(tensors: dict[StateKind, torch.Tensor]) -> bool:
    """Whether the kernel takes these tensors: contiguous CPU pieces (any stored view is) of
    the dtypes it decodes (fp32, bf16, int8 codes); anything else steps on torch's ops."""
    return all(
        t.device.type == "cpu" and t.is_contiguous() and t.dtype in KERNEL_DTYPES
        for t in tensors.values()
    )


def step_piece(
    run: Callable,
    formats: StateFormats,
    tensors: dict[StateKind, torch.Tensor],
    spans: Sequence[tuple[int, int, float, int]],
    scalars: Sequence[Sequence[float]],
    keys: Sequence[Sequence[int]],
    origin: int,
    sub_block: int,
) -> None:
    """One AdamW update of a piece by `run` (`load()`): `spans` as `CompactStep.step`'s,
    with each one's `step.adamw_scalars` and its random keys per stream (`STREAMS`' order)."""
    numel = tensors[StateKind.GRAD].numel()
    assert sub_block % CHUNK == 0 and CHUNK % STATE_BLOCK == 0, (sub_block, CHUNK)
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    bounds = np.array([spans[i][:2] for i in order], dtype=np.int64).reshape(-1, 2)
    assert (bounds[1:, 0] >= bounds[:-1, 1]).all(), "spans overlap"
    touched = np.zeros(-(-numel // sub_block), dtype=np.uint8)
    for a, b in bounds:
        touched[a // sub_block : (b - 1) // sub_block + 1] = 1
    p32, p16, _, _ = _arrays(formats, StateKind.MASTER, tensors[StateKind.MASTER], numel)
    m32, m16, mq, ma = _arrays(formats, StateKind.EXP_AVG, tensors[StateKind.EXP_AVG], numel)
    v32, v16, vq, va = _arrays(formats, StateKind.EXP_AVG_SQ, tensors[StateKind.EXP_AVG_SQ], numel)
    g32, g16, _, _ = _arrays(formats, StateKind.GRAD, tensors[StateKind.GRAD], numel)
    fmt = np.array([_format(formats, kind, tensors[kind]) for kind in PIECE], dtype=np.int64)
    with _LOCK:
        run(
            numel,
            p32,
            p16,
            m32,
            m16,
            mq,
            ma,
            v32,
            v16,
            vq,
            va,
            g32,
            g16,
            fmt,
            CHUNK,
            touched,
            sub_block,
            np.ascontiguousarray(bounds[:, 0]),
            np.ascontiguousarray(bounds[:, 1]),
            np.array([scalars[i] for i in order], dtype=np.float32).reshape(-1, 8),
            np.array([keys[i] for i in order], dtype=np.uint64).reshape(-1, len(STREAMS)),
            origin,
        )


def _format(formats: StateFormats, kind: StateKind, stored: torch.Tensor) -> int:
    if formats.quantised(kind):
        return 2
    return 0 if stored.dtype == torch.float32 else 1


def _arrays(
    formats: StateFormats, kind: StateKind, stored: torch.Tensor, numel: int
) -> tuple[np.ndarray, ...]:
    """A stored piece as the kernel's (fp32, bf16 bits, codes, absmax), the unused ones empty."""
    f32, b16, codes, absmax = _EMPTY
    if formats.quantised(kind):
        absmax, codes = (t.numpy() for t in split(stored, numel))
    elif stored.dtype == torch.float32:
        f32 = stored.numpy()
    else:
        assert stored.dtype == torch.bfloat16, stored.dtype
        b16 = stored.view(torch.uint16).numpy()
    return f32, b16, codes, absmax
