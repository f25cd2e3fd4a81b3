"""The compact step's CPU kernel: decode, step and encode a piece in one pass, in numba.

`step_piece` hands a piece's chunks of `chunk_numel` values (`cpu_step.CHUNK`: whole
quantisation blocks) to every core: a chunk's master, moments and grad are decoded into fp32
arrays of its own (L2-sized), the values its spans cover are stepped with AdamW, and the chunk
is encoded back in place (an fp32 state is stepped where it is stored: no copy in or out). It is
the arithmetic of `tierzero.compact.step`'s torch ops, written so every fp32 result is rounded
once where torch's op rounds it (no fused multiply-add: numba contracts only with fastmath,
which is off; `error_model="numpy"`: IEEE division, no zero check), with torch's own sqrt
(`bind_sqrt`), so the two paths agree bitwise; `tests/test_compact_kernel.py` holds them to it.
It also keeps the torch path's sub-blocks: a chunk whose sub-block no span reaches is not
touched, any other is re-encoded whole (values no span covers keep their bf16 bits or their
nearest code), exactly as the torch path re-encodes sub-blocks.

One signature serves every format (each state's stored arrays are passed, an empty array for the
forms it does not use, and `fmt` says which), so numba compiles it once per machine and
`cache=True` keeps it. The table lookups of int8 codes run in loops of their own and the
arithmetic in loops LLVM vectorises: on AMD Zen 4 vector gathers measured slower than scalar
loads. numba widens uint32 arithmetic to 64 bits and turns arithmetic with an untyped constant
into float64, so every constant is typed, and the hash is written in LLVM's 32-bit
instructions (`_mix`).
"""

from __future__ import annotations

import ctypes
import os

import llvmlite.binding
import numba
import numpy as np
import torch
from numba import carray, cfunc, njit, prange, types
from numba.extending import intrinsic

FP32, BF16, INT8 = 0, 1, 2  # `fmt` of a state
BLOCK = 256  # STATE_BLOCK: checked against the config by the caller
MASK32 = np.uint64(0xFFFFFFFF)
LOW16 = np.uint32(0xFFFF)
HIGH16 = np.uint64(0xFFFF0000)
SHIFT = np.uint32(16)
MIX1 = np.uint32(0x7FEB352D)
MIX2 = np.uint32(0x2C1B3C6D)
LOW32 = np.uint64(0xFFFFFFFF)  # a packed table entry's low half
HIGH32 = np.uint64(32)
SQRT_RUN = 2048  # values per sqrt call: MKL may thread longer runs, inside numba's threads
ABS = np.uint32(0x7FFFFFFF)
INF_BITS = np.uint32(0x7F800000)
NAN_F32 = np.uint32(0x7FC00000)  # what torch.amax returns for a block holding a NaN
NAN_BF16 = np.uint16(0xFFFF)  # what torch's fp32 -> bf16 copy stores for any NaN
HALF_GAP = np.uint32(1 << 15)
ONE = np.float32(1.0)
# sqrt of n fp32 values from one address into another, in a VML mode (`bind_sqrt`)
SQRT_SIGNATURE = types.void(types.int32, types.intp, types.intp, types.uint64)
_SQRT = types.ExternalFunction("tierzero_compact_sqrt", SQRT_SIGNATURE)
# torch's: VML_HA | FTZDAZ_OFF | ERRMODE_IGNORE
VML_MODE = np.uint64(0x00000002 | 0x00140000 | 0x00000100)


def bind_sqrt() -> None:
    """Point the kernel's sqrt at the one `torch.sqrt` runs on fp32 CPU tensors: MKL's vmsSqrt
    where torch is built with MKL (it is not IEEE's sqrt: on random values a fifth of its
    results are an ulp off the correctly rounded one, so nothing else gives torch's bits),
    else the correctly rounded sqrt that torch's vectorised kernels compute. The symbol is
    bound by name, so numba's cached machine code links to it in every process."""
    if torch.backends.mkl.is_available():
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        address = ctypes.cast(lib.vmsSqrt, ctypes.c_void_p).value
    else:
        address = _ieee_sqrt.address
    llvmlite.binding.add_symbol("tierzero_compact_sqrt", address)


@cfunc(
    types.void(
        types.int32, types.CPointer(types.float32), types.CPointer(types.float32), types.uint64
    ),
    cache=True,
)
def _ieee_sqrt(n, src, dst, mode):
    a, out = carray(src, n), carray(dst, n)
    for j in range(n):
        out[j] = np.sqrt(a[j])


@intrinsic
def _mix(typingctx, h):
    """`step._mix_int`'s rounds on a uint32, in 32-bit LLVM instructions (numba's widening to
    64 bits leaves LLVM 8 lanes of 64-bit multiplies, a third slower), and its low 16 bits."""

    def codegen(context, builder, signature, args):
        (h,) = args
        for mult in (MIX1, MIX2):
            h = builder.xor(h, builder.lshr(h, h.type(int(SHIFT))))
            h = builder.mul(h, h.type(int(mult)))
        h = builder.xor(h, builder.lshr(h, h.type(int(SHIFT))))
        return builder.and_(h, h.type(int(LOW16)))

    return types.uint32(types.uint32), codegen


@njit(cache=True, error_model="numpy")
def _fill_bits(out, first, key):
    """16 random bits per position first, first + 1, ... of the unit's flat buffer
    (`step.random_bits`), 16 lanes of 32 bits at a time (`_mix`)."""
    base = np.uint32(np.uint64(first) & MASK32)
    key = np.uint32(key)
    for j in range(out.shape[0]):
        out[j] = _mix(np.uint32(np.uint32(base + np.uint32(j)) ^ key))


@njit(cache=True, error_model="numpy")
def _decode(out, fmt, b16, codes, absmax, table):
    """A run of whole blocks (the last may be shorter) of one stored state, as fp32 into `out`
    (an fp32 state's `out` is the stored run itself: `_working`)."""
    if fmt == BF16:
        raw = out.view(np.uint32)
        for j in range(out.shape[0]):
            raw[j] = np.uint32(b16[j]) << np.uint32(16)
    elif fmt == INT8:
        for k in range(absmax.shape[0]):
            scale = absmax[k]
            block = out[k * BLOCK : (k + 1) * BLOCK]
            block_codes = codes[k * BLOCK : (k + 1) * BLOCK]
            for j in range(block.shape[0]):
                block[j] = table[block_codes[j]] * scale


@njit(cache=True, error_model="numpy")
def _encode(values, bits, fmt, b16, codes, absmax, buckets, pairs):
    """fp32 `values` (a run of whole blocks) back into one state's stored form, rounded by
    `bits` (`step.round_stochastic`, `codes.quantise`); `values` is overwritten. An fp32 state
    was stepped where it is stored (`_working`)."""
    raw = values.view(np.uint32)
    if fmt == BF16:
        for j in range(values.shape[0]):  # add the bits below the kept ones and truncate
            r = np.uint32((np.uint64(raw[j]) + np.uint64(bits[j])) & HIGH16)
            b16[j] = NAN_BF16 if (r & ABS) > INF_BITS else np.uint16(r >> SHIFT)
    elif fmt == INT8:
        found = np.empty(BLOCK, np.uint64)
        lower = np.empty(BLOCK, np.uint32)
        for k in range(absmax.shape[0]):
            block = slice(k * BLOCK, (k + 1) * BLOCK)
            absmax[k] = _quantise(
                values[block], bits[block], codes[block], buckets, pairs, found, lower
            )


@njit(cache=True, error_model="numpy")
def _quantise(values, bits, codes, buckets, pairs, found, lower):
    """One block's codes (`codes.quantise`); returns its absmax. `buckets`: per bucket its
    lower code (high half) and the next code's fp32 bits (low half); `pairs`: per code the fp32
    bits of its gap scale (high half) and of itself (low half); `found`, `lower`: scratch. The
    table lookups run in loops of their own, the arithmetic in loops that vectorise."""
    n = values.shape[0]
    raw = values.view(np.uint32)
    top = np.uint32(0)  # the block's absmax as bits: |x|'s order is its bits' order
    for j in range(n):
        top = max(top, raw[j] & ABS)
    absmax = np.uint32(NAN_F32 if top > INF_BITS else top).view(np.float32)
    divisor = absmax if absmax > 0 else ONE  # a zero or NaN block is divided by 1
    for j in range(n):
        values[j] = values[j] / divisor
    for j in range(n):
        found[j] = buckets[raw[j] >> SHIFT]
    for j in range(n):  # the lower code: the bucket's, or the next if at or past it
        e = found[j]
        past = values[j] >= np.uint32(e & LOW32).view(np.float32)
        lower[j] = np.uint32(((e >> HIGH32) + np.uint64(past)) & np.uint64(0xFF))
    for j in range(n):
        found[j] = pairs[lower[j]]
    for j in range(n):  # up past the bits: the fraction of the gap, in 1/65536ths
        e = found[j]
        code = np.uint32(e & LOW32).view(np.float32)
        d = (values[j] - code) * np.uint32(e >> HIGH32).view(np.float32)
        codes[j] = np.uint8((lower[j] + np.uint32(d > np.float32(bits[j]))) & np.uint32(0xFF))
    return absmax


@njit(cache=True, error_model="numpy")
def _adamw(p, m, v, g, root, decay, scalars):
    """`step.adamw_math` on equal runs of values; `scalars`: `step.adamw_scalars` as fp32;
    `root`: scratch for sqrt(v), which torch's sqrt computes (`bind_sqrt`). Loops each write
    one or two arrays, so the vectoriser's overlap checks stay few."""
    wdf, b1, omb1, b2, omb2 = scalars[0], scalars[1], scalars[2], scalars[3], scalars[4]
    bc2, eps, step_size = scalars[5], scalars[6], scalars[7]
    if decay:
        for j in range(p.shape[0]):
            p[j] = p[j] * wdf
    for j in range(m.shape[0]):
        m[j] = m[j] * b1 + g[j] * omb1
    for j in range(v.shape[0]):
        v[j] = v[j] * b2 + (g[j] * g[j]) * omb2
    for a in range(0, v.shape[0], SQRT_RUN):
        run = min(SQRT_RUN, v.shape[0] - a)
        _SQRT(run, v[a:].ctypes.data, root[a:].ctypes.data, VML_MODE)
    for j in range(p.shape[0]):
        p[j] = p[j] - (m[j] / (root[j] / bc2 + eps)) * step_size


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
               touched, sub_block, span_starts, span_ends, decays, scalars, keys, origin, table,
               buckets, pairs):  # fmt: skip
    """AdamW on a piece of `n` values, in place in its stored master (p), moments (m, v) and
    grad (g): each state's fp32 array, bf16 bits (uint16), int8 codes and absmax, the unused
    ones empty, `fmt[s]` saying which it is (numba's parallel loops take arrays, not tuples of
    them). Each task steps `chunk_numel` values (whole blocks), within one sub-block:
    `touched[i]`: whether sub-block i (`sub_block` values, a multiple of `chunk_numel`) holds
    part of a span; spans (sorted, disjoint): [span_starts[i], span_ends[i]) with weight decay
    where `decays[i]`, fp32 `scalars[i]` and 32-bit random `keys[i, s]` per state; `origin`:
    the piece's position in its unit's flat buffer; per code map (row 0 unsigned, 1 signed) its
    codes (`table`) and the quantiser's packed `buckets` and `pairs` (`_quantise`)."""
    for chunk in prange((n + chunk_numel - 1) // chunk_numel):
        a = chunk * chunk_numel
        b = min(a + chunk_numel, n)
        if not touched[a // sub_block]:
            continue
        # master, moments, grad, a root; bits for the three stored states (1-D arrays, not
        # rows of one: numba types a row's slice as strided, which does not vectorise)
        p = _working(fmt[0], p32[a:b], b - a)
        m = _working(fmt[1], m32[a:b], b - a)
        v = _working(fmt[2], v32[a:b], b - a)
        g, root = _working(fmt[3], g32[a:b], b - a), _floats(b - a)
        bp, bm, bv = _words(b - a), _words(b - a), _words(b - a)
        blocks = slice(a // BLOCK, (b + BLOCK - 1) // BLOCK)
        _decode(p, fmt[0], p16[a:b], mq, ma, table[0])
        _decode(m, fmt[1], m16[a:b], mq[a:b], ma[blocks], table[1])
        _decode(v, fmt[2], v16[a:b], vq[a:b], va[blocks], table[0])
        _decode(g, fmt[3], g16[a:b], mq, ma, table[0])
        bp[:] = np.uint32(0)  # outside the spans: a bf16 stays, an int8 code is the nearest
        bm[:] = HALF_GAP if fmt[1] == INT8 else np.uint32(0)
        bv[:] = HALF_GAP if fmt[2] == INT8 else np.uint32(0)
        i = np.searchsorted(span_ends, a, side="right")
        while i < span_ends.shape[0] and span_starts[i] < b:
            lo = max(span_starts[i], a) - a
            hi = min(span_ends[i], b) - a
            _adamw(p[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi], root[lo:hi], decays[i], scalars[i])
            first = origin + a + lo
            if fmt[0] != FP32:
                _fill_bits(bp[lo:hi], first, keys[i, 0])
            if fmt[1] != FP32:
                _fill_bits(bm[lo:hi], first, keys[i, 1])
            if fmt[2] != FP32:
                _fill_bits(bv[lo:hi], first, keys[i, 2])
            i += 1
        _encode(p, bp, fmt[0], p16[a:b], mq, ma, buckets[0], pairs[0])
        _encode(m, bm, fmt[1], m16[a:b], mq[a:b], ma[blocks], buckets[1], pairs[1])
        _encode(v, bv, fmt[2], v16[a:b], vq[a:b], va[blocks], buckets[0], pairs[0])
