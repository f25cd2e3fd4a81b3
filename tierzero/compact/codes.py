"""Blockwise dynamic int8 quantisation of Adam moments: the code maps, quantise and dequantise.

A moment is quantised in blocks of `STATE_BLOCK` values counted from the start of its piece,
each block sharing one fp32 absmax: a value is stored as the index (0..255) of an entry of a
256-entry code map of `value / absmax`. The maps are the dynamic ones of 8-bit Adam (Dettmers
et al., 2022): per decade of magnitude from 1e-7 to 1 a linear run of codes, more codes in the
larger decades, so small and large values keep a similar relative precision. exp_avg uses the
signed map, exp_avg_sq (never negative) the unsigned one, which spends all 256 codes on
magnitudes.

The step rounds stochastically between the two codes around a value: up with the probability
of the value's fraction of the gap between them, compared with 16 random bits. Round-to-nearest
is biased here: a moment moves by a few percent a step, less than half the gap between its
codes, so it sticks to its code, and where the gaps widen (each decade's first code) it
rounds more often one way; measured along one training trajectory, nearest-code moments made
Adam's updates 2-9% larger than fp32 moments did, stochastic ones within 1%. Without random
bits (`StateFormats.encode`: states converted, not stepped) the comparison is with half the
gap: the nearest code.

One exception to both: a positive exp_avg_sq below the smallest positive code is stored as that
code, never as 0. Adam divides by sqrt(exp_avg_sq): rounding a small one to 0 while its
exp_avg is not turns the update into exp_avg / eps (seen: weights of rare embedding rows
jumping 20 lr in one step), while rounding it up only shrinks that parameter's update. Every
function works on one run of whole blocks (the last one may be shorter), so a piece, or any
block-aligned part of one, quantises on its own, bitwise the same as within the whole piece.
No allocation beyond the outputs and `Scratch` handed in.
"""

from __future__ import annotations

import functools
import math

import torch

from tierzero.config import STATE_BLOCK

MAX_EXPONENT = 7  # decades of magnitude the dynamic map spans below 1
HALF_GAP = 1 << 15  # without random bits: round up past half the gap (the nearest code)


@functools.cache
def code_map(signed: bool) -> torch.Tensor:
    """The 256 sorted fp32 codes of the dynamic map (8-bit Adam's `create_dynamic_map`)."""
    data: list[float] = [0.0, 1.0]
    for i in range(MAX_EXPONENT):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
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


@functools.cache
def gap_scales(signed: bool) -> torch.Tensor:
    """Per code index, 65536 over the gap to the next code (0 for the last): a value's fraction
    of the gap above its lower code, in units of the 16 random bits it is compared with."""
    table = code_map(signed)
    scales = torch.zeros(256, dtype=torch.float32)
    scales[:-1] = 65536.0 / (table[1:] - table[:-1])
    return scales


@functools.cache
def lower_buckets(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value of an fp32's top 16 bits (a bucket of the values that share their bf16
    truncation): the index of the largest code at or below the bucket's lowest value, and the
    code after it, which the bucket's values are compared with. No bucket holds two codes (the
    codes are at least 2**-7 of a value apart, a bucket 2**-7 wide), so a value's lower code is
    the bucket's start, plus one if it is at or above that next code: `searchsorted(right=True)
    - 1` in two table lookups instead of a binary search. The unsigned map's exception is folded
    in: positive buckets below its first positive code start at code 1 and compare with +inf.
    (+0's bucket, which holds the positive subnormals, starts at 0 and compares with the least of
    them.)"""
    table = code_map(signed)
    patterns = torch.arange(1 << 16, dtype=torch.int64) << 16
    edges = [(patterns | low).to(torch.int32).view(torch.float32) for low in (0, 0xFFFF)]
    # NaN buckets: 0
    lowest, highest = (f(*edges).nan_to_num() for f in (torch.minimum, torch.maximum))
    starts = (torch.searchsorted(table, lowest, right=True) - 1).clamp_(0, 255)
    assert (torch.searchsorted(table, highest, right=True) - 1 - starts <= 1).all()
    nexts = torch.cat([table, torch.tensor([math.inf])])[starts + 1]
    if not signed:
        below = (lowest > 0) & (starts == 0)
        starts[below], nexts[below] = 1, math.inf
        # +0's bucket: any positive subnormal is code 1
        nexts[0] = torch.tensor(0.0).nextafter(torch.tensor(1.0))
    return starts, nexts


class Scratch:
    """Working buffers for quantising up to `numel` values at once, reused call after call. The
    lookups index by int32 (half the bytes of int64); the bucket tables are uint8 starts and
    fp32 next codes, both indexed by a value's top 16 bits, so the two lookups do not wait on
    each other and the codes are written as uint8 straight away."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.numel = numel
        self.device = device
        self.other = torch.empty(numel, dtype=torch.float32, device=device)
        self.bits = torch.empty(numel, dtype=torch.int32, device=device)
        self.codes = {s: code_map(s).to(device) for s in (False, True)}
        self.scales = {s: gap_scales(s).to(device) for s in (False, True)}
        self.starts = {s: lower_buckets(s)[0].to(device, torch.uint8) for s in (False, True)}
        self.nexts = {s: lower_buckets(s)[1].to(device) for s in (False, True)}

    @staticmethod
    def nbytes(numel: int) -> int:
        """What a `Scratch(numel)` holds -- an fp32 and an int32 per value, and for both maps
        the codes and gap scales (fp32) and the bucket starts (uint8) and next codes (fp32) --
        plus the one bool per value a comparison allocates while it runs."""
        tables = 2 * 256 * 4 + (1 << 16) * (1 + 4)
        return numel * (4 + 4 + 1) + 2 * tables


def _whole_and_tail(x: torch.Tensor) -> list[tuple[torch.Tensor, slice]]:
    """`x` as 2-D views of whole blocks and its shorter last block, with each one's range of
    blocks."""
    full = x.numel() // STATE_BLOCK
    out = []
    if full:
        out.append((x[: full * STATE_BLOCK].view(full, STATE_BLOCK), slice(0, full)))
    if x.numel() % STATE_BLOCK:
        out.append((x[full * STATE_BLOCK :].view(1, -1), slice(full, full + 1)))
    return out


def quantise(
    values: torch.Tensor,
    signed: bool,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    scratch: Scratch,
    bits: torch.Tensor | None = None,
) -> None:
    """Write the codes of fp32 `values` into uint8 `codes` and each block's absmax into fp32
    `absmax` (`nblocks(values.numel())` of them): rounded up past the fraction of the gap that
    int32 `bits` (16 random bits per value) give, or past half of it without them (see the
    module's docstring). `values` is overwritten. A block of zeros stores absmax 0 and code 0.0."""
    n = values.numel()
    other = scratch.other[:n]
    torch.abs(values, out=other)
    for (block, rows), (magnitude, _) in zip(_whole_and_tail(values), _whole_and_tail(other)):
        top = absmax[rows]
        torch.amax(magnitude, dim=1, out=top)
        block.div_(torch.where(top > 0, top, torch.ones_like(top)).unsqueeze(1))
    lower(values, signed, scratch, codes)
    index = scratch.bits[:n]
    index.copy_(codes)
    torch.index_select(scratch.codes[signed], 0, index, out=other)
    values.sub_(other)
    torch.index_select(scratch.scales[signed], 0, index, out=other)
    # the fraction of the gap above the lower code, in 1/65536ths (exact scaling)
    values.mul_(other)
    if bits is None:
        up = torch.gt(values, HALF_GAP)
    else:
        other.copy_(bits)
        up = torch.gt(values, other)
    codes.add_(up.view(torch.uint8))


def lower(values: torch.Tensor, signed: bool, scratch: Scratch, out: torch.Tensor) -> None:
    """uint8 `out`: the index of each normalised value's lower code, by its bucket
    (`lower_buckets`)."""
    n = values.numel()
    bucket, bound = scratch.bits[:n], scratch.other[:n]
    torch.bitwise_right_shift(values.view(torch.int32), 16, out=bucket).bitwise_and_(0xFFFF)
    torch.index_select(scratch.starts[signed], 0, bucket, out=out)
    torch.index_select(scratch.nexts[signed], 0, bucket, out=bound)
    # a fresh bool tensor: comparisons into `out=` run about 4x slower on the CPU (torch 2.13)
    out.add_(torch.ge(values, bound).view(torch.uint8))


def dequantise(
    codes: torch.Tensor, absmax: torch.Tensor, signed: bool, out: torch.Tensor, scratch: Scratch
) -> None:
    """Fill fp32 `out` with the values uint8 `codes` stand for: code * its block's absmax."""
    n = codes.numel()
    index = scratch.bits[:n]
    index.copy_(codes)
    torch.index_select(scratch.codes[signed], 0, index, out=out)
    for block, rows in _whole_and_tail(out):
        block.mul_(absmax[rows].unsqueeze(1))
