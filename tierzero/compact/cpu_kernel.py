"""The compact step's CPU kernel: decode, step and encode a piece in one pass, in numba.

`step_piece` hands a piece's chunks of `chunk_numel` values (`cpu_step.CHUNK`: whole
quantisation blocks) to every core: a chunk's master, moments and grad are decoded into fp32
arrays of its own (L2-sized), the values its spans cover are stepped with AdamW in one loop, and
the chunk is encoded back in place (an fp32 state is stepped where it is stored: no copy in or
out). It is the arithmetic of `tierzero.compact.step`'s torch ops, written so every fp32 result
is rounded once where torch's op rounds it (no fused multiply-add: numba contracts only with
fastmath, which is off; `error_model="numpy"`: IEEE division, no zero check; IEEE's sqrt, which
the torch ops compute too), so the two paths agree bitwise; `tests/test_compact_kernel.py` holds
them to it. It also keeps the torch path's sub-blocks: a chunk whose sub-block no span reaches
is not touched, any other is re-encoded whole (values no span covers keep their bf16 bits or
their nearest code), exactly as the torch path re-encodes sub-blocks.

One signature serves every format (each state's stored arrays are passed, an empty array for the
forms it does not use, and `fmt` says which), so numba compiles it once per machine and
`cache=True` keeps it. An int8 code is an fp32's top bits (`tierzero.compact.codes`), so coding
and decoding are integer operations on bit patterns (`_float`, `_bits`: LLVM bitcasts) that
vectorise; numba widens uint32 arithmetic to 64 bits and turns arithmetic with an untyped
constant into float64, so every constant is typed, and the hash is written in LLVM's 32-bit
instructions (`_mix`).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from tierzero.compact import codes as codes_mod
from tierzero.compact.cpu_bits import (
    as_float,
    code_signed,
    code_unsigned,
    mix,
    round_bf16,
    value_signed,
    value_unsigned,
    widen_bf16,
)

FP32, BF16, INT8 = 0, 1, 2  # `fmt` of a state
BLOCK = 256  # STATE_BLOCK: checked against the config by the caller
MASK32 = np.uint64(0xFFFFFFFF)
ABS = np.uint32(0x7FFFFFFF)
INF_BITS = np.uint32(codes_mod.INF_BITS)
NAN_F32 = np.uint32(0x7FC00000)  # what torch.amax returns for a block holding a NaN
BOTH_HALF_GAPS = np.uint32(codes_mod.HALF_GAP * 0x10001)  # without random bits, in both halves
LOW_HALF, HIGH_HALF = np.uint32(0), np.uint32(16)  # exp_avg's bits, exp_avg_sq's
TOP = np.float32(codes_mod.TOP)
ZERO = np.float32(0.0)
TINY, LIFT = np.float32(codes_mod.TINY), np.float32(codes_mod.LIFT)


@njit(cache=True, error_model="numpy")
def _fill_bits(out, first, key):
    """32 random bits per position first, first + 1, ... of the unit's flat buffer, the low 16
    one state's and the high 16 another's (`step.random_bits`), 16 lanes of 32 bits at a time
    (`cpu_bits.mix`)."""
    base = np.uint32(np.uint64(first) & MASK32)
    key = np.uint32(key)
    for j in range(out.shape[0]):
        out[j] = mix(np.uint32(np.uint32(base + np.uint32(j)) ^ key))


@njit(cache=True, error_model="numpy")
def _decode(out, fmt, b16, codes, scales, signed):
    """A run of whole blocks (the last may be shorter) of one stored state, as fp32 into `out`
    (an fp32 state's `out` is the stored run itself: `_working`): a code's value
    (`codes.code_map`) times its block's scale."""
    if fmt == BF16:
        for j in range(out.shape[0]):
            out[j] = widen_bf16(b16[j])
    elif fmt == INT8:
        for k in range(scales.shape[0]):
            scale = scales[k]
            block = out[k * BLOCK : (k + 1) * BLOCK]
            block_codes = codes[k * BLOCK : (k + 1) * BLOCK]
            if signed:  # the loops apart: each vectorises without a branch
                for j in range(block.shape[0]):
                    block[j] = value_signed(block_codes[j]) * scale
            else:
                for j in range(block.shape[0]):
                    block[j] = value_unsigned(block_codes[j]) * scale


@njit(cache=True, error_model="numpy")
def _encode(values, bits, shift, fmt, b16, codes, scales, signed):
    """fp32 `values` (a run of whole blocks) back into one state's stored form, rounded by the
    16 `bits` from bit `shift` on (`step.round_stochastic`, `codes.quantise`). An fp32 state was
    stepped where it is stored (`_working`)."""
    raw = values.view(np.uint32)
    if fmt == BF16:
        for j in range(values.shape[0]):
            b16[j] = round_bf16(raw[j], bits[j], shift)
    elif fmt == INT8:
        for k in range(scales.shape[0]):
            block = slice(k * BLOCK, (k + 1) * BLOCK)
            scales[k] = _quantise(values[block], bits[block], shift, codes[block], signed)


@njit(cache=True, error_model="numpy")
def _quantise(values, bits, shift, codes, signed):
    """One block's codes (`codes.quantise`); returns its scale."""
    n = values.shape[0]
    raw = values.view(np.uint32)
    top = np.uint32(0)  # the block's absmax as bits: |x|'s order is its bits' order
    for j in range(n):
        top = max(top, raw[j] & ABS)
    absmax = as_float(NAN_F32 if top > INF_BITS else top)
    inverse = ZERO
    if absmax < TINY:  # lifted first (exactly), so the inverse is finite
        for j in range(n):
            values[j] = values[j] * LIFT
        inverse = TOP / (absmax * LIFT) if absmax > ZERO else ZERO
    else:
        inverse = TOP / absmax if absmax > ZERO else ZERO
    if signed:  # the loops apart: each vectorises without a branch
        for j in range(n):
            codes[j] = np.uint8(code_signed(raw[j], bits[j], shift, inverse))
    else:
        for j in range(n):
            codes[j] = np.uint8(code_unsigned(raw[j], bits[j], shift, inverse))
    return absmax / TOP


@njit(cache=True, error_model="numpy")
def _adamw(p, m, v, g, scalars):
    """`step.adamw_math` on equal runs of values, in one loop; `scalars`: `step.adamw_scalars`
    as fp32 (the decay factor is 1 where there is no decay: multiplying by it is exact)."""
    wdf, b1, omb1, b2, omb2 = scalars[0], scalars[1], scalars[2], scalars[3], scalars[4]
    bc2, eps, step_size = scalars[5], scalars[6], scalars[7]
    for j in range(p.shape[0]):
        gj = g[j]
        mj = m[j] * b1 + gj * omb1
        vj = v[j] * b2 + (gj * gj) * omb2
        m[j] = mj
        v[j] = vj
        p[j] = p[j] * wdf - (mj / (np.sqrt(vj) / bc2 + eps)) * step_size


def run(*args) -> None:
    """`step_piece(*args)` on as many of numba's threads as torch uses on the calling thread
    (the optimizer's thread sizes its team: `IOLoop`'s math lane). Starting numba's OpenMP
    layer (once a process) leaves the calling thread's OpenMP team at all of numba's threads,
    and that is torch's thread count too (one libgomp): it is set back, so a step leaves
    torch's threads as it found them."""
    threads = torch.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    step_piece(*args)


@njit(cache=True)
def _floats(n):
    return np.empty(n, np.float32)


@njit(cache=True)
def _working(fmt, f32, n):
    """The fp32 values of a chunk of one state to step: an fp32 state's stored run itself (no
    copy in or out), any other's a chunk array it is decoded into."""
    return f32 if fmt == FP32 else _floats(n)


@njit(cache=True)
def _words(n):
    return np.empty(n, np.uint32)


@njit(parallel=True, cache=True, error_model="numpy")
def step_piece(n, p32, p16, m32, m16, mq, ma, v32, v16, vq, va, g32, g16, fmt, chunk_numel,
               touched, sub_block, span_starts, span_ends, scalars, keys, origin):  # fmt: skip
    """AdamW on a piece of `n` values, in place in its stored master (p), moments (m, v) and
    grad (g): each state's fp32 array, bf16 bits (uint16), int8 codes and scales, the unused
    ones empty, `fmt[s]` saying which it is (numba's parallel loops take arrays, not tuples of
    them). Each task steps `chunk_numel` values (whole blocks), within one sub-block:
    `touched[i]`: whether sub-block i (`sub_block` values, a multiple of `chunk_numel`) holds
    part of a span; spans (sorted, disjoint): [span_starts[i], span_ends[i]) with fp32
    `scalars[i]` and the 32-bit keys of the master's and the moments' random bits
    (`keys[i, 0]`, `keys[i, 1]`); `origin`: the piece's position in its unit's flat buffer."""
    for chunk in prange((n + chunk_numel - 1) // chunk_numel):
        a = chunk * chunk_numel
        b = min(a + chunk_numel, n)
        if not touched[a // sub_block]:
            continue
        # master, moments, grad; bits for the three stored states (1-D arrays, not rows of
        # one: numba types a row's slice as strided, which does not vectorise)
        p = _working(fmt[0], p32[a:b], b - a)
        m = _working(fmt[1], m32[a:b], b - a)
        v = _working(fmt[2], v32[a:b], b - a)
        g = _working(fmt[3], g32[a:b], b - a)
        bp, bm = _words(b - a), _words(b - a)  # the master's bits, and the moments' (two halves)
        blocks = slice(a // BLOCK, (b + BLOCK - 1) // BLOCK)
        _decode(p, fmt[0], p16[a:b], mq, ma, 0)
        _decode(m, fmt[1], m16[a:b], mq[a:b], ma[blocks], 1)
        _decode(v, fmt[2], v16[a:b], vq[a:b], va[blocks], 0)
        _decode(g, fmt[3], g16[a:b], mq, ma, 0)
        i = np.searchsorted(span_ends, a, side="right")
        if i == span_ends.shape[0] or span_starts[i] > a or span_ends[i] < b:
            # values outside the spans: a bf16 stays, an int8 code is the nearest
            bp[:] = np.uint32(0)
            bm[:] = BOTH_HALF_GAPS if fmt[1] == INT8 else np.uint32(0)
        while i < span_ends.shape[0] and span_starts[i] < b:
            lo = max(span_starts[i], a) - a
            hi = min(span_ends[i], b) - a
            _adamw(p[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi], scalars[i])
            first = origin + a + lo
            if fmt[0] != FP32:
                _fill_bits(bp[lo:hi], first, keys[i, 0])
            if fmt[1] != FP32:
                _fill_bits(bm[lo:hi], first, keys[i, 1])
            i += 1
        _encode(p, bp, LOW_HALF, fmt[0], p16[a:b], mq, ma, 0)
        _encode(m, bm, LOW_HALF, fmt[1], m16[a:b], mq[a:b], ma[blocks], 1)
        _encode(v, bm, HIGH_HALF, fmt[2], v16[a:b], vq[a:b], va[blocks], 0)
