"""Blockwise 8-bit quantisation of Adam moments: small floats under a per-block scale.

A moment is quantised in blocks of `STATE_BLOCK` values counted from the start of its piece,
each block sharing one fp32 scale: a value is stored as a byte `q` and stands for
`code_map(signed)[q] * scale`. The scale is the block's absmax over `TOP` (31/32, the largest
code), so the block's largest magnitude is the top code, to an ulp of the scale.

The codes are small floats with 4 mantissa bits whose bit patterns are fp32's (`MANTISSA`):
above the 16 evenly spaced codes near zero (`LINEAR`), code `q` is the fp32 whose bits are
`(q + offset) << 19`. exp_avg's signed codes are a sign bit and 7 bits of magnitude: 7
binades, 2**-7 to 31/32, at 3-6% relative steps, and steps of 2**-11 below; exp_avg_sq's
unsigned ones spend all 8 bits on magnitude: 15 binades, 2**-15 to 31/32, steps of 2**-19
below. 8-bit Adam's dynamic map (per decade a linear run of codes) steps 1.4-14% in a block's
top decade, 2.8-28% in the next and 5.6-56% in the third: finer only for the top octave of
exp_avg. Why these codes rather than it, though: a code is fp32's bits, so a value is encoded
by adding random bits to its own bit pattern and shifting, and decoded by shifting back -- no
table lookup and no search, whole vectors at a time on a CPU or a GPU (the dynamic map's
lookups held the CPU step to 0.14x of fused AdamW; docs/measurements.md).

The step rounds stochastically between the two codes around a value: the 16 random bits are
added just below the kept ones (as bf16's stochastic rounding does), so the value rounds up
with the probability of its fraction of the gap (to 2**-16). Round-to-nearest is biased here:
a moment moves by a few percent a step, less than half the gap between its codes, so it sticks
to its code. Without random bits (`StateFormats.encode`: states converted, not stepped) half the
gap is added: the nearest code, ties up.

One exception: a positive exp_avg_sq below the smallest positive code is stored as that code,
never as 0. Adam divides by sqrt(exp_avg_sq): rounding a small one to 0 while its exp_avg is
not turns the update into exp_avg / eps (seen: weights of rare embedding rows jumping 20 lr in
one step), while rounding it up only shrinks that parameter's update. Every function works on
one run of whole blocks (the last one may be shorter), so a piece, or any block-aligned part of
one, quantises on its own, bitwise the same as within the whole piece. Only integer operations
follow the one rounding multiplication by the block's inverse scale (any NaN it makes coded as
the top code, whatever its sign and payload on the device), so the CPU kernel
(`cpu_kernel`) and these torch ops agree bitwise on any device.
"""

from __future__ import annotations

import functools
import struct

import torch

from tierzero.config import STATE_BLOCK

MANTISSA = 4  # mantissa bits a code keeps
DROP = 23 - MANTISSA  # fp32 mantissa bits a code drops
LINEAR = 1 << MANTISSA  # evenly spaced codes below the smallest binade
TOP = 31 / 32  # the largest code: 0.5 * (1 + 15/16)
TOP_BITS = 0x3F780000  # TOP's fp32 bits
INF_BITS = 0x7F800000  # any NaN is clamped to this before it is coded (payloads differ by device)
HALF_GAP = 1 << 15  # without random bits: add half the dropped range (the nearest code)
# the random bits' hash (`step.random_bits`, `cpu_bits.mix`): odd multipliers below 2**31 (so
# int32 constants)
MIX = (0x7FEB352D, 0x2C1B3C6D)
SIGN = 0x80  # a signed code's sign bit
# a block whose absmax is below TINY is scaled by LIFT first (exact), so TOP / absmax is finite
TINY, LIFT = 2.0**-100, 2.0**64


def magnitude_mask(signed: bool) -> int:
    """The bits of a code that hold its magnitude."""
    return 0x7F if signed else 0xFF


def offset(signed: bool) -> int:
    """What a code adds to become the top bits of its fp32: the top code is `TOP`."""
    return (TOP_BITS >> DROP) - magnitude_mask(signed)


def smallest_binade(signed: bool) -> float:
    """The least code above the linear ones, 2**-7 (signed) or 2**-15 (unsigned): the linear
    codes step by it / `LINEAR`."""
    return 2.0 ** ((((LINEAR + offset(signed)) << DROP) >> 23) - 127)


@functools.cache
def code_map(signed: bool) -> torch.Tensor:
    """The 256 fp32 values the codes stand for, by code (the signed map's codes 128-255 are the
    negatives of 0-127)."""
    mask = magnitude_mask(signed)
    magnitude = torch.arange(256, dtype=torch.int32) & mask
    binade = ((magnitude + offset(signed)) << DROP).view(torch.float32)
    linear = magnitude.float() * (smallest_binade(signed) / LINEAR)
    values = torch.where(magnitude < LINEAR, linear, binade)
    if signed:
        values = torch.where(torch.arange(256) >= SIGN, -values, values)
    return values


def nblocks(numel: int) -> int:
    """Quantisation blocks of a run of `numel` values (the last one may be shorter)."""
    return -(-numel // STATE_BLOCK)


class Scratch:
    """Working buffers for quantising up to `numel` values at once, reused call after call:
    an fp32 and two int32 per value, and both code maps on the device."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.numel = numel
        self.device = device
        self.scaled = torch.empty(numel, dtype=torch.float32, device=device)
        self.code = torch.empty(numel, dtype=torch.int32, device=device)
        self.other = torch.empty(numel, dtype=torch.int32, device=device)
        self.maps = {s: code_map(s).to(device) for s in (False, True)}

    @staticmethod
    def nbytes(numel: int) -> int:
        """What a `Scratch(numel)` holds, plus the one bool per value a comparison allocates
        while it runs."""
        return numel * (4 + 4 + 4 + 1) + 2 * 256 * 4


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
    scales: torch.Tensor,
    scratch: Scratch,
    bits: torch.Tensor | None = None,
) -> None:
    """Write the codes of fp32 `values` into uint8 `codes` and each block's scale into fp32
    `scales` (`nblocks(values.numel())` of them), rounded up with the probability that int32
    `bits` (16 random bits per value) give, or to the nearest without them (see the module's
    docstring). A block of zeros stores scale 0 and codes 0."""
    n = values.numel()
    raw = values.view(torch.int32)
    scaled, code, other = scratch.scaled[:n], scratch.code[:n], scratch.other[:n]
    torch.bitwise_and(raw, 0x7FFFFFFF, out=scaled.view(torch.int32))  # |x|, NaN payloads kept
    for (block, rows), _ in zip(_whole_and_tail(scaled), _whole_and_tail(values)):
        top = scales[rows]
        torch.amax(block, dim=1, out=top)
        lift = torch.where(top < TINY, LIFT, 1.0)
        # a tensor divided, not a scalar by a tensor (torch takes the reciprocal, then multiplies)
        inverse = torch.full_like(top, TOP).div_(top * lift)
        inverse.masked_fill_(~(top > 0), 0.0)
        block.mul_(lift.unsqueeze(1)).mul_(inverse.unsqueeze(1))
        top.div_(TOP)
    if bits is None:
        other.fill_(HALF_GAP << (DROP - 16))
    else:
        torch.bitwise_left_shift(bits, DROP - 16, out=other)
    least = smallest_binade(signed)
    tiny = torch.lt(scaled, least)
    # the linear codes: the scaled value plus the smallest binade, whose ulp is 2**-DROP of a
    # linear code's step, then shifted as the binades' bits are
    linear = code.view(torch.float32)
    torch.add(scaled, least, out=linear)
    code.sub_(float_bits(least)).add_(other).bitwise_right_shift_(DROP)
    # the binades: the bits (any NaN as inf's) plus the random ones, shifted, less the offset
    binade = scaled.view(torch.int32)
    binade.bitwise_and_(0x7FFFFFFF).clamp_(max=INF_BITS).add_(other).bitwise_right_shift_(DROP)
    binade.sub_(offset(signed)).clamp_(max=magnitude_mask(signed))
    torch.where(tiny, code, binade, out=code)
    if signed:
        torch.bitwise_right_shift(raw, 31, out=other).bitwise_and_(SIGN)
        code.bitwise_or_(other)
    else:
        code.add_((torch.gt(values, 0) & torch.eq(code, 0)).view(torch.uint8))
    codes.copy_(code)


def float_bits(value: float) -> int:
    """The bits of `value` as an fp32, as a non-negative int."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def dequantise(
    codes: torch.Tensor, scales: torch.Tensor, signed: bool, out: torch.Tensor, scratch: Scratch
) -> None:
    """Fill fp32 `out` with the values uint8 `codes` stand for: its code's value * its block's
    scale."""
    n = codes.numel()
    index = scratch.code[:n]
    index.copy_(codes)
    torch.index_select(scratch.maps[signed], 0, index, out=out)
    for block, rows in _whole_and_tail(out):
        block.mul_(scales[rows].unsqueeze(1))
