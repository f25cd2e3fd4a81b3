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


class Scratch:
    """Working buffers for quantising up to `numel` values at once, reused call after call."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.numel = numel
        self.device = device
        self.index = torch.empty(numel, dtype=torch.int64, device=device)
        self.low = torch.empty(numel, dtype=torch.float32, device=device)
        self.high = torch.empty(numel, dtype=torch.float32, device=device)
        self.codes: dict[bool, torch.Tensor] = {s: code_map(s).to(device) for s in (False, True)}


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
    index, low, high = scratch.index[:n], scratch.low[:n], scratch.high[:n]
    torch.abs(values, out=low)
    for (block, rows), (magnitude, _) in zip(_whole_and_tail(values), _whole_and_tail(low)):
        top = absmax[rows]
        torch.amax(magnitude, dim=1, out=top)
        block.div_(torch.where(top > 0, top, torch.ones_like(top)).unsqueeze(1))
    table = scratch.codes[signed]
    torch.searchsorted(table, values, out=index)  # first code >= value: the nearest is it or the one below
    index.clamp_(1, 255)
    torch.index_select(table, 0, index, out=high)
    torch.sub(high, values, out=high)  # distance up
    index.sub_(1)
    torch.index_select(table, 0, index, out=low)
    torch.sub(values, low, out=low)  # distance down
    index.add_(high < low)  # ties keep the lower code
    if not signed:  # a positive exp_avg_sq never becomes 0: see the module's docstring
        index.add_((index == 0) & (values > 0))
    codes.copy_(index)


def dequantise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool, out: torch.Tensor,
               scratch: Scratch) -> None:
    """Fill fp32 `out` with the values uint8 `codes` stand for: code * its block's absmax."""
    n = codes.numel()
    index = scratch.index[:n]
    index.copy_(codes)
    torch.index_select(scratch.codes[signed], 0, index, out=out)
    for block, rows in _whole_and_tail(out):
        block.mul_(absmax[rows].unsqueeze(1))
