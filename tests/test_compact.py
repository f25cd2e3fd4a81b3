"""Compact optimizer state, piece by piece: int8 round trips within their code gaps, stochastic
rounding to the two codes around a value without bias, and the sub-block step equal, bitwise,
to the same AdamW formula applied in plain PyTorch to the whole decoded piece (with its random
bits recomputed here in numpy's wrapping uint32 arithmetic, its sqrt in fp64, and its codes
found by binary search in the sorted code map and rounded up by their fraction of the gap)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tierzero.compact import codes
from tierzero.compact.formats import StateFormats, split
from tierzero.compact.step import (
    SUB_BLOCK,
    CompactStep,
    ieee_sqrt,
    random_bits,
    step_scratch,
    stream_key,
)
from tierzero.config import STATE_BLOCK, Config, StateKind

MOMENTS = {StateKind.EXP_AVG: True, StateKind.EXP_AVG_SQ: False}  # kind -> signed code map


def _blocks_of(n: int, seed: int, signed: bool) -> torch.Tensor:
    """Values of every scale: each block with its own magnitude, zeros, a block of zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 1, n)[torch.randperm(n, generator=g)]
    x[STATE_BLOCK : 2 * STATE_BLOCK] = 0.0
    x[5] = 0.0
    return x if signed else x.abs()


def _magnitudes(signed: bool) -> torch.Tensor:
    """The code map's non-negative values, sorted: index = a code's magnitude bits."""
    return codes.code_map(signed)[: 128 if signed else 256].double()


@pytest.mark.parametrize("signed", [True, False])
def test_a_round_trip_stays_within_half_the_gap_between_the_codes_around_each_value(
    signed: bool,
) -> None:
    n = 3 * STATE_BLOCK + 777  # a shorter last block
    x = _blocks_of(n, 0, signed)
    nb = codes.nblocks(n)
    q, scales, out = torch.empty(n, dtype=torch.uint8), torch.empty(nb), torch.empty(n)
    scratch = codes.Scratch(n, torch.device("cpu"))
    codes.quantise(x.clone(), signed, q, scales, scratch)
    codes.dequantise(q, scales, signed, out, scratch)
    table = _magnitudes(signed)
    for k in range(nb):
        block = slice(k * STATE_BLOCK, min(n, (k + 1) * STATE_BLOCK))
        top = x[block].abs().max()
        assert scales[k] == top / codes.TOP  # the block's absmax over the top code
        if top == 0:
            assert torch.equal(out[block], torch.zeros_like(out[block]))
            continue
        y = x[block].double().abs() / scales[k].double()
        hi = torch.searchsorted(table, y).clamp(max=len(table) - 1)
        lo = (hi - 1).clamp(min=0)
        bound = (table[hi] - table[lo]) / 2 + 1e-6 * y  # half the gap (and the scale's ulps)
        if not signed:  # a positive exp_avg_sq below the smallest positive code is that code
            bound = torch.where((y > 0) & (y < table[1]), table[1], bound)
            assert (out[block][x[block] > 0] > 0).all()  # never 0: Adam divides by its root
        assert (torch.sign(out[block]) == torch.sign(x[block]))[out[block] != 0].all()
        error = (out[block].double().abs() / scales[k].double() - y).abs()
        assert (error <= bound).all(), (k, (error - bound).max())
        big = y >= 2 * codes.smallest_binade(signed)  # in the binades: within 1/32 of itself
        assert (error[big] <= y[big] / 32 + 1e-6).all()
        i = k * STATE_BLOCK + int(x[block].abs().argmax())  # the largest value: to an ulp
        assert abs(float(out[i]) - float(x[i])) <= 2 * abs(float(x[i])) * 2**-23


def test_the_code_map_is_fp32_bit_patterns_with_four_mantissa_bits() -> None:
    """Above the 16 linear codes, each binade holds 16 codes (steps of 1/32-1/16 of a value),
    up to 31/32; below, the linear codes step by a 16th of the smallest binade."""
    for signed, binades, least in ((True, 7, 2.0**-7), (False, 15, 2.0**-15)):
        table = _magnitudes(signed)
        assert codes.smallest_binade(signed) == least and table[-1] == codes.TOP
        assert len(table) == 16 * (binades + 1) and (table[1:] > table[:-1]).all()
        assert torch.equal(table[:16], torch.arange(16).double() * least / 16)
        relative = (table[17:] - table[16:-1]) / table[16:-1]
        assert relative.min() >= 1 / 32 - 1e-12 and relative.max() <= 1 / 16 + 1e-12
    signed_map = codes.code_map(True)
    assert torch.equal(signed_map[128:], -signed_map[:128])  # the sign bit


def test_a_piece_quantises_block_by_block_as_its_parts_do() -> None:
    """Blocks count from the piece's start: quantising a 2048-aligned part alone gives its bytes."""
    n = 5 * STATE_BLOCK + 100
    x = _blocks_of(n, 1, True)
    whole = StateFormats(moments="int8").encode(StateKind.EXP_AVG, x)
    absmax, q = split(whole, n)
    part = StateFormats(moments="int8").encode(StateKind.EXP_AVG, x[2 * STATE_BLOCK :])
    part_absmax, part_q = split(part, n - 2 * STATE_BLOCK)
    assert torch.equal(part_q, q[2 * STATE_BLOCK :]) and torch.equal(part_absmax, absmax[2:])
    assert whole.dtype == torch.uint8 and whole.numel() == 4 * codes.nblocks(n) + n


def _ref_bits(
    config: Config, step: int, unit: int, kind: StateKind, positions: np.ndarray
) -> np.ndarray:
    """The stochastic-rounding bits, recomputed with numpy's wrapping uint32 arithmetic: the
    low half of the hash, the high half for exp_avg_sq (whose stream is exp_avg's)."""
    h = (positions & 0xFFFFFFFF).astype(np.uint32) ^ np.uint32(
        stream_key(config.seed, step, unit, kind)
    )
    for mult in (0x7FEB352D, 0x2C1B3C6D):
        h ^= h >> np.uint32(16)
        h *= np.uint32(mult)
    h ^= h >> np.uint32(16)
    if kind is StateKind.EXP_AVG_SQ:
        h >>= np.uint32(16)
    return (h & np.uint32(0xFFFF)).astype(np.uint32)


def _ref_round(values: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    raw = values.numpy().view(np.uint32) + bits  # wraps like int32 bit patterns
    return torch.from_numpy((raw & np.uint32(0xFFFF0000)).view(np.float32)).to(torch.bfloat16)


def reference_step(
    formats: StateFormats,
    stored: dict[StateKind, torch.Tensor],
    grad: torch.Tensor,
    spans: list,
    lr: float,
    config: Config,
    unit: int,
    origin: int,
) -> dict[StateKind, torch.Tensor]:
    """Plain PyTorch: decode the whole piece, apply AdamW's formula per span, encode the whole
    piece."""
    n = grad.numel()
    values = {kind: formats.decode(kind, t, torch.empty(n)) for kind, t in stored.items()}
    p, m, v = values[StateKind.MASTER], values[StateKind.EXP_AVG], values[StateKind.EXP_AVG_SQ]
    beta1, beta2 = config.optimizer.betas
    for a, b, wd, k in spans:
        t, g = k + 1, grad[a:b]
        if wd:
            p[a:b] = p[a:b] * (1 - lr * wd)
        m[a:b] = m[a:b] * beta1 + g * (1 - beta1)
        v[a:b] = v[a:b] * beta2 + (g * g) * (1 - beta2)
        root = torch.from_numpy(np.sqrt(v[a:b].numpy()))  # IEEE's fp32 sqrt
        denom = root / math.sqrt(1 - beta2**t) + config.optimizer.eps
        p[a:b] = p[a:b] - (m[a:b] / denom) * (lr / (1 - beta1**t))
    out = {}
    for kind, t in stored.items():
        if t.dtype == torch.float32:
            out[kind] = values[kind]
            continue
        # outside the spans: nearest code, or as stored
        rest = 0x8000 if formats.quantised(kind) else 0
        bits = np.full(n, rest, dtype=np.uint32)
        for a, b, _, k in spans:
            bits[a:b] = _ref_bits(config, k + 1, unit, kind, np.arange(origin + a, origin + b))
        out[kind] = (
            _ref_quantise(values[kind], kind is StateKind.EXP_AVG, bits)
            if formats.quantised(kind)
            else _ref_round(values[kind].clone(), bits)
        )
    return out


def _ref_quantise(values: torch.Tensor, signed: bool, bits: np.ndarray) -> torch.Tensor:
    """Blockwise scale, then between the two codes around each value by binary search in the
    sorted magnitudes: up where its fraction of the gap, in 2**-19ths (exact in fp64), plus
    8 x its 16 random bits reaches a whole gap. Below the smallest binade the value is first
    rounded to the 2**-19ths of a linear step that fp32 holds there."""
    n, table = values.numel(), _magnitudes(signed)
    x = values.numpy().astype(np.float64)
    absmax = np.array([np.abs(x[i : i + STATE_BLOCK]).max() for i in range(0, n, STATE_BLOCK)])
    absmax = absmax.astype(np.float32)
    lift = np.where(absmax < codes.TINY, np.float32(codes.LIFT), np.float32(1.0))
    with np.errstate(divide="ignore"):
        inverse = np.where(absmax > 0, np.float32(codes.TOP) / (absmax * lift), np.float32(0))
    per_value = np.repeat(np.arange(len(absmax)), STATE_BLOCK)[:n]
    y = (np.abs(values.numpy()) * lift[per_value]).astype(np.float32) * inverse[per_value]
    least = np.float32(codes.smallest_binade(signed))
    tiny = y < least
    y = np.where(tiny, (y + least).astype(np.float64) - least, y.astype(np.float64))
    y = np.where(np.isnan(y), table[-1].item(), y)  # a NaN is the top code
    t = torch.from_numpy(table.numpy())
    lo = (torch.searchsorted(t, torch.from_numpy(y), right=True) - 1).clamp(min=0).numpy()
    gap = np.append(np.diff(table.numpy()), np.inf)[lo]
    fraction = (y - table.numpy()[lo]) / gap * 2**19
    assert (fraction == np.floor(fraction)).all()  # exact: the codes' gaps are powers of two
    code = np.minimum(lo + (fraction + 8 * bits >= 2**19), len(table) - 1)
    if signed:
        code = code | np.where(np.signbit(values.numpy()), 128, 0)
    else:
        code = np.where((values.numpy() > 0) & (code == 0), 1, code)
    packed = torch.empty(4 * codes.nblocks(n) + n, dtype=torch.uint8)
    got_scales, got_codes = split(packed, n)
    got_scales.copy_(torch.from_numpy(absmax) / codes.TOP)
    got_codes.copy_(torch.from_numpy(code.astype(np.uint8)))
    return packed


@pytest.mark.parametrize(
    "moments,master",
    [("int8", "bf16"), ("int8", "fp32"), ("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "bf16")],
)
def test_a_compact_step_equals_the_formula_in_plain_pytorch_bitwise(
    moments: str, master: str
) -> None:
    formats = StateFormats(moments=moments, master=master)
    config = Config(lr=1e-3, weight_decay=0.1, seed=7)
    n = 2 * SUB_BLOCK["cpu"] + 3 * STATE_BLOCK + 555  # three sub-blocks, the last block shorter
    g = torch.Generator().manual_seed(3)
    stored = {
        StateKind.MASTER: formats.encode(StateKind.MASTER, torch.randn(n, generator=g) * 0.05),
        StateKind.EXP_AVG: formats.encode(StateKind.EXP_AVG, torch.randn(n, generator=g) * 1e-3),
        StateKind.EXP_AVG_SQ: formats.encode(
            StateKind.EXP_AVG_SQ, torch.rand(n, generator=g) * 1e-6
        ),
    }
    grad = torch.randn(n, generator=g) * 1e-2
    # runs of different step counts and decay, one across a sub-block edge, and values no run covers
    spans = [
        (0, 1000, 0.1, 0),
        (1000, SUB_BLOCK["cpu"] + 4097, 0.0, 5),
        (SUB_BLOCK["cpu"] + 9000, n, 0.1, 2),
    ]
    expected = reference_step(
        formats,
        {k: t.clone() for k, t in stored.items()},
        grad,
        spans,
        1e-3,
        config,
        unit=3,
        origin=12345,
    )
    tensors = {**stored, StateKind.GRAD: grad}
    CompactStep(formats, config.optimizer, config.seed, torch.device("cpu")).step(
        tensors, spans, 1e-3, unit=3, origin=12345
    )
    for kind, want in expected.items():
        assert torch.equal(tensors[kind], want), kind
    untouched = slice(SUB_BLOCK["cpu"] + 4097, SUB_BLOCK["cpu"] + 9000)
    assert torch.equal(tensors[StateKind.MASTER][untouched], expected[StateKind.MASTER][untouched])


def test_stochastic_rounding_is_unbiased_where_round_to_nearest_loses_the_update() -> None:
    """An update a hundred times below a bf16 ulp: round-to-nearest keeps the old weight, the
    stochastic rounding moves the mean by the update."""
    formats = StateFormats(master="bf16")
    config = Config(lr=1e-4, seed=1)
    n = 4 * SUB_BLOCK["cpu"]
    assert torch.tensor(1 - 1e-4).to(torch.bfloat16) == 1  # what round-to-nearest would store
    master = torch.ones(n, dtype=torch.bfloat16)
    tensors = {
        StateKind.MASTER: master,
        StateKind.GRAD: torch.ones(n),
        StateKind.EXP_AVG: torch.zeros(n),
        StateKind.EXP_AVG_SQ: torch.zeros(n),
    }
    CompactStep(formats, config.optimizer, config.seed, torch.device("cpu")).step(
        tensors, [(0, n, 0.0, 0)], 1e-4, unit=0, origin=0
    )
    moved = 1 - master.double().mean().item()
    assert abs(moved - 1e-4) < 2e-5, moved  # Adam's first step moves each weight by lr (5 sigma)


@pytest.mark.parametrize("signed", [True, False])
def test_every_code_and_every_midpoint_codes_as_the_sorted_map_says(signed: bool) -> None:
    """Without random bits: each code's value is itself, a midpoint goes up, its fp32
    neighbours go to the nearer code, values down to the subnormals and NaN as the reference."""
    table = _magnitudes(signed).float()
    mids = (table[:-1] + table[1:]) / 2
    edges = torch.cat(
        [table, mids, mids.nextafter(torch.tensor(2.0)), mids.nextafter(torch.tensor(-2.0))]
    )
    g = torch.Generator().manual_seed(2)
    spread = torch.rand(1 << 14, generator=g) * torch.logspace(-44, 0, 1 << 14)
    x = torch.cat([edges, spread, torch.tensor([0.0, float("nan")])]).clamp(max=codes.TOP)
    x = torch.cat([x, -x]) if signed else x
    n = x.numel()
    # each value in a block of its own, whose absmax is the top code: y is the value itself
    blocks = torch.full((n, STATE_BLOCK), codes.TOP)
    blocks[:, 1] = x
    flat = blocks.reshape(-1)
    q, scales = torch.empty(flat.numel(), dtype=torch.uint8), torch.empty(n)
    codes.quantise(flat.clone(), signed, q, scales, codes.Scratch(flat.numel(), flat.device))
    want = split(_ref_quantise(flat, signed, np.full(flat.numel(), 1 << 15)), flat.numel())[1]
    assert torch.equal(q, want)
    got = q.view(n, STATE_BLOCK)[:, 1]
    assert torch.equal(got[: len(table)].long() & 0x7F, torch.arange(len(table)) & 0x7F)
    assert torch.equal(got[len(table) : 2 * len(table) - 1].long() & 0xFF,
                       torch.arange(1, len(table)) & 0xFF)  # fmt: skip


@pytest.mark.parametrize("signed", [True, False])
def test_int8_stochastic_rounding_is_unbiased_and_keeps_to_the_two_codes_around_a_value(
    signed: bool,
) -> None:
    """One value quantised with every one of the 65536 random draws: each code is one of the two
    around it, their mean is the value (to the draws' 2**-16 resolution), and a moment far less
    than half a gap from its code -- where nearest rounding sticks -- moves in expectation."""
    table = _magnitudes(signed).float()
    n = 1 << 16
    for target in (
        0.5 * (table[100] + table[101]) + 0.3 * (table[101] - table[100]),
        table[20] * 1.001,
        table[5] + 0.3 * (table[6] - table[5]),  # among the linear codes
    ):
        x = torch.full((n,), float(target))
        x[::STATE_BLOCK] = codes.TOP  # each block's scale is 1: the values stay as they are
        q, scales, out = (
            torch.empty(n, dtype=torch.uint8),
            torch.empty(codes.nblocks(n)),
            torch.empty(n),
        )
        scratch = codes.Scratch(n, torch.device("cpu"))
        bits = torch.randperm(n, generator=torch.Generator().manual_seed(0)).to(torch.int32)
        codes.quantise(x.clone(), signed, q, scales, scratch, bits)
        codes.dequantise(q, scales, signed, out, scratch)
        kept = torch.ones(n, dtype=torch.bool)
        kept[::STATE_BLOCK] = False
        lo = int(torch.searchsorted(table, torch.tensor(float(target)), right=True)) - 1
        assert set(q[kept].unique().tolist()) == {lo, lo + 1}
        mean = out[kept].double().mean().item()
        gap = float(table[lo + 1] - table[lo])
        assert abs(mean - float(target)) < gap * 2**-10, (mean, float(target))
        nearest = torch.empty_like(q)
        # no bits: the nearest code, for all
        codes.quantise(x.clone(), signed, nearest, scales, scratch)
        assert len(nearest[kept].unique()) == 1


@pytest.mark.parametrize("start", [2**31 - 1000, 2**32 - 1000, 5 * 2**32 + 7])
def test_the_random_bits_wrap_as_uint32_arithmetic_does_past_the_int32_range(start: int) -> None:
    """The int32 hash (wrapping mul and add, masked shifts) equals numpy's uint32 one where the
    positions cross 2**31 and 2**32."""
    config, n = Config(seed=11), 3000
    out = torch.empty(n, dtype=torch.int32)
    scratch = step_scratch(SUB_BLOCK["cpu"], torch.device("cpu"))
    random_bits(config.seed, 4, 2, StateKind.MASTER, start, n, scratch, out)
    want = _ref_bits(config, 4, 2, StateKind.MASTER, np.arange(start, start + n, dtype=np.int64))
    assert np.array_equal(out.numpy().astype(np.uint32), want)


def test_the_torch_ops_sqrt_is_ieees_as_the_kernels_is() -> None:
    """`ieee_sqrt` (the torch ops' sqrt) equals numpy's fp32 sqrt, which is IEEE's, on values of
    every exponent, the subnormals, zeros and infinity."""
    g = torch.Generator().manual_seed(4)
    v = torch.rand(1 << 20, generator=g) * torch.logspace(-45, 38, 1 << 20)
    v = torch.cat([v, torch.tensor([0.0, -0.0, float("inf"), 1e-45, 3.4e38])])
    out = torch.empty_like(v)
    ieee_sqrt(v, out)
    assert np.array_equal(out.numpy().view(np.uint32), np.sqrt(v.numpy()).view(np.uint32))
