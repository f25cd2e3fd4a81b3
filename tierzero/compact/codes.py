"""Blockwise dynamic int8 quantisation of Adam moments: the code maps, quantise and dequantise.

A moment is quantised in blocks of `STATE_BLOCK` values counted from the start of its piece,
each block sharing one fp32 absmax: a value is stored as the index (0..255) of the nearest
entry of a 256-entry code map of `value / absmax`. The maps are the dynamic ones of 8-bit Adam
(Dettmers et al., 2022): per decade of magnitude from 1e-7 to 1 a linear run of codes, more
codes in the larger decades, so small and large values keep a similar relative precision.
exp_avg uses the signed map, exp_avg_sq (never negative) the unsigned one, which spends all 256
codes on magnitudes. One exception to the nearest code: a positive exp_avg_sq below half the
smallest positive code is stored as that code, never as 0. Adam divides by sqrt(exp_avg_sq):
rounding a small one to 0 while its exp_avg is not turns the update into exp_avg / eps (seen:
weights of rare embedding rows jumping 20 lr in one step), while rounding it up only shrinks
that parameter's update. Every function works on one run of whole blocks (the last one may be
shorter), so a piece, or any 2048-aligned part of one, quantises on its own, bitwise the same
as within the whole piece. No allocation beyond the outputs and `Scratch` handed in.
"""

from __future__ import annotations

import functools
import math

import torch

from tierzero.config import STATE_BLOCK

MAX_EXPONENT = 7  # decades of magnitude the dynamic map spans below 1


@functools.lru_cache(maxsize=None)
def code_map(signed: bool) -> torch.Tensor:
    """The 256 sorted fp32 codes of the dynamic map (8-bit Adam's `create_dynamic_map`)."""
    data: list[float] = [0.0, 1.0]
    for i in range(MAX_EXPONENT):
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = ((bounds[:-1] + bounds[1:]) / 2.0).tolist()
        scale = 10.0 ** (-(MAX_EXPONENT - 1) + i)
        data += [scale * m for m in means]
        if signed:
            data += [-scale * m for m in means]
    assert len(data) == 256
    return torch.tensor(sorted(data), dtype=torch.float32)


def nblocks(numel: int) -> int:
    """Quantisation blocks of a run of `numel` values (the last one may be shorter)."""
    return -(-numel // STATE_BLOCK)


def midpoints(signed: bool) -> torch.Tensor:
    """The 255 midpoints between neighbouring codes: a value's nearest code is the number of
    midpoints below it (a value on a midpoint keeps the lower code)."""
    table = code_map(signed)
    return (table[:-1] + table[1:]) / 2


@functools.lru_cache(maxsize=None)
def bucket_starts(signed: bool) -> torch.Tensor:
    """Per value of an fp32's top 16 bits (a bucket of the values that share their bf16
    truncation): how many midpoints lie below every value of the bucket. No bucket holds two
    midpoints (the codes are at least 2**-7 of a value apart, a bucket 2**-7 wide), so a value's
    code is its bucket's start, plus one if it lies above the next midpoint: `torch.searchsorted`
    exactly, in two table lookups instead of a binary search."""
    bounds = midpoints(signed)
    patterns = torch.arange(1 << 16, dtype=torch.int64) << 16
    edges = [(patterns | low).to(torch.int32).view(torch.float32) for low in (0, 0xFFFF)]
    lowest, highest = torch.minimum(*edges), torch.maximum(*edges)
    starts = torch.searchsorted(bounds, lowest.nan_to_num())  # midpoints below the bucket's lowest value
    assert (torch.searchsorted(bounds, highest.nan_to_num(), right=True) - starts <= 1).all()
    return starts.clamp_(max=bounds.numel() - 1)


@functools.lru_cache(maxsize=None)
def bucket_bounds(signed: bool) -> torch.Tensor:
    """Per bucket (`bucket_starts`), the midpoint its values are compared with: the next one."""
    return midpoints(signed)[bucket_starts(signed)]


@functools.lru_cache(maxsize=None)
def stored_buckets(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`bucket_starts` and `bucket_bounds` with the unsigned map's exception folded in (a
    positive value below the first midpoint is stored as code 1, see the module's docstring):
    such buckets start at 1 and compare with +inf; the bucket of +0 and the positive subnormals
    starts at 0 and compares with 0.0. The signed map's are the plain ones."""
    starts, bounds = bucket_starts(signed).clone(), bucket_bounds(signed).clone()
    if not signed:
        lowest = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
        below = (lowest > 0) & (starts == 0)  # finite positive buckets below the first midpoint (not NaN)
        starts[below], bounds[below] = 1, math.inf
        bounds[0] = 0.0
    return starts, bounds


class Scratch:
    """Working buffers for quantising up to `numel` values at once, reused call after call. The
    lookups index by int32 (half the bytes of int64) and the bucket tables are uint8 starts and
    fp32 next midpoints, both indexed by a value's top 16 bits, so the two lookups do not wait
    on each other and the codes are written as uint8 straight away."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.numel = numel
        self.device = device
        self.index = torch.empty(numel, dtype=torch.uint8, device=device)
        self.magnitude = torch.empty(numel, dtype=torch.float32, device=device)
        self.bits = torch.empty(numel, dtype=torch.int32, device=device)
        self.codes: dict[bool, torch.Tensor] = {s: code_map(s).to(device) for s in (False, True)}
        self.starts = {s: bucket_starts(s).to(device, torch.uint8) for s in (False, True)}
        self.bounds = {s: bucket_bounds(s).to(device) for s in (False, True)}
        self.stored = {s: (stored_buckets(s)[0].to(device, torch.uint8), stored_buckets(s)[1].to(device))
                       for s in (False, True)}

    @staticmethod
    def nbytes(numel: int) -> int:
        """What a `Scratch(numel)` holds -- index, magnitude, bits per value, and for both maps
        the codes (fp32), bucket starts (uint8) and bounds (fp32), plain and stored -- plus the
        one bool per value a lookup's comparison allocates while it runs."""
        tables = 256 * 4 + (1 << 16) * (1 + 4) * 2
        return numel * (1 + 4 + 4 + 1) + 2 * tables


def _whole_and_tail(x: torch.Tensor) -> list[tuple[torch.Tensor, slice]]:
    """`x` as 2-D views of whole blocks and its shorter last block, with each one's range of blocks."""
    full = x.numel() // STATE_BLOCK
    out = []
    if full:
        out.append((x[:full * STATE_BLOCK].view(full, STATE_BLOCK), slice(0, full)))
    if x.numel() % STATE_BLOCK:
        out.append((x[full * STATE_BLOCK:].view(1, -1), slice(full, full + 1)))
    return out


def quantise(values: torch.Tensor, signed: bool, codes: torch.Tensor, absmax: torch.Tensor,
             scratch: Scratch) -> None:
    """Write the nearest-code indices of fp32 `values` into uint8 `codes` and each block's
    absmax into fp32 `absmax` (`nblocks(values.numel())` of them). `values` is overwritten
    with the normalised values. A block of zeros stores absmax 0 and code 0.0."""
    n = values.numel()
    magnitudes = scratch.magnitude[:n]
    torch.abs(values, out=magnitudes)
    for (block, rows), (magnitude, _) in zip(_whole_and_tail(values), _whole_and_tail(magnitudes)):
        top = absmax[rows]
        torch.amax(magnitude, dim=1, out=top)
        block.div_(torch.where(top > 0, top, torch.ones_like(top)).unsqueeze(1))
    _lookup(values, *scratch.stored[signed], scratch, codes)


def nearest(values: torch.Tensor, signed: bool, scratch: Scratch, index: torch.Tensor) -> None:
    """The nearest code's index of each normalised value: `torch.searchsorted(midpoints(signed),
    values)`, by the bucket of its top 16 bits (`bucket_starts`); `index`: uint8, or any integer
    dtype by way of the scratch's uint8."""
    n = values.numel()
    out = index if index.dtype == torch.uint8 else scratch.index[:n]
    _lookup(values, scratch.starts[signed], scratch.bounds[signed], scratch, out)
    if out is not index:
        index.copy_(out)


def _lookup(values: torch.Tensor, starts: torch.Tensor, bounds: torch.Tensor, scratch: Scratch,
            out: torch.Tensor) -> None:
    """uint8 `out`: each value's bucket's start, plus one where the value lies above its bound."""
    n = values.numel()
    bits, bound = scratch.bits[:n], scratch.magnitude[:n]
    torch.bitwise_right_shift(values.view(torch.int32), 16, out=bits).bitwise_and_(0xFFFF)
    torch.index_select(starts, 0, bits, out=out)
    torch.index_select(bounds, 0, bits, out=bound)
    # a fresh bool tensor: comparisons into `out=` run about 4x slower on the CPU (torch 2.13)
    out.add_(torch.gt(values, bound).view(torch.uint8))


def dequantise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool, out: torch.Tensor,
               scratch: Scratch) -> None:
    """Fill fp32 `out` with the values uint8 `codes` stand for: code * its block's absmax."""
    n = codes.numel()
    index = scratch.bits[:n]
    index.copy_(codes)
    torch.index_select(scratch.codes[signed], 0, index, out=out)
    for block, rows in _whole_and_tail(out):
        block.mul_(absmax[rows].unsqueeze(1))
