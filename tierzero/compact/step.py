"""`CompactStep`: AdamW on one piece whose master or moments are stored compact (bf16, int8).

The piece is stepped in sub-blocks of `SUB_BLOCK` values (a multiple of `STATE_BLOCK`, so each
holds whole quantisation blocks): each sub-block's master and moments are decoded into fp32
scratch, stepped in fp32, and encoded back into the stored piece. The scratch (about 10 MiB,
allocated at the first step and reused) is all the fp32 state that ever exists: never a fp32
copy of a piece, let alone of a unit. fp32 master or moments are stepped in place.

The formula is torch's AdamW (decoupled weight decay, bias-corrected moments), written as
single-rounding elementwise ops (mul, add, div, sqrt; no fused multiply-add), so a value's
result does not depend on where a sub-block or vector lane cuts: the step equals the same
formula applied to the whole decoded piece in plain PyTorch, bitwise (tests hold this).
torch's own fused kernel rounds differently, which is why fp32 state keeps it instead.

bf16 master weights and bf16 moments are written with stochastic rounding (see
docs/design.md, "Compact optimizer state"): the fp32 result's low 16 bits plus 16 random bits,
truncated, rounds up with probability equal to the discarded fraction, so updates far below a
bf16 ulp still move the weight in expectation. int8 moments round stochastically between the
two codes around a value with the same 16 bits (`codes.quantise`). The random bits are a hash
of (seed, step count, unit, state kind, the value's position in the unit's flat buffer) -- no generator state, so a
resumed run draws the very bits the uninterrupted one would, whatever the piece size.
"""

from __future__ import annotations

import math
import threading

import torch

from tierzero.compact import codes as codes_mod
from tierzero.compact.formats import StateFormats, split
from tierzero.config import STATE_BLOCK, Config, StateKind

SUB_BLOCK = {"cpu": 1 << 18, "cuda": 1 << 18}  # values per sub-block (whole STATE_BLOCKs): fewer, larger ops
F32_SCRATCH = ("master", "exp_avg", "exp_avg_sq", "t1", "t2")  # a sub-block's decoded states and temporaries
INT_SCRATCH = ("shift", "bits")  # stochastic rounding's hash (int32)
_MASK32 = 0xFFFFFFFF
_MIX = (0x7FEB352D, 0x2C1B3C6D)  # odd multipliers below 2**31 (so int32 constants)
_KIND_STREAM = {StateKind.MASTER: 1, StateKind.EXP_AVG: 2, StateKind.EXP_AVG_SQ: 3}

Span = tuple[int, int, float, int]  # (start, end) in the piece, weight decay, updates already applied


class CompactStep:
    def __init__(self, formats: StateFormats, config: Config, device: torch.device) -> None:
        self.formats = formats
        self.config = config
        self.device = device
        self.block = SUB_BLOCK.get(device.type, SUB_BLOCK["cpu"])
        self._scratch: dict[str, torch.Tensor] | None = None
        self._codes: codes_mod.Scratch | None = None
        self._lock = threading.Lock()  # one scratch: the training thread's and the optimizer lane's steps take turns

    def _buffers(self) -> dict[str, torch.Tensor]:
        if self._scratch is None:
            f32 = {name: torch.empty(self.block, dtype=torch.float32, device=self.device) for name in F32_SCRATCH}
            ints = {name: torch.empty(self.block, dtype=torch.int32, device=self.device) for name in INT_SCRATCH}
            offsets = torch.arange(self.block, dtype=torch.int32, device=self.device)  # arange is slow: add to these
            self._scratch = {**f32, **ints, "offsets": offsets}
            self._codes = codes_mod.Scratch(self.block, self.device)
        return self._scratch

    def step(self, tensors: dict[StateKind, torch.Tensor], spans: list[Span], lr: float, unit: int,
             origin: int) -> None:
        """One AdamW update of a piece's `spans` (piece offsets, per-span weight decay and step
        count), in place in the stored `tensors` (master, grad, moments); `origin`: the piece's
        first value's offset in its unit's flat buffer (stochastic rounding's position)."""
        grad = tensors[StateKind.GRAD]
        numel = grad.numel()
        with self._lock:
            scratch = self._buffers()
            for s in range(0, numel, self.block):
                e = min(s + self.block, numel)
                inside = [(max(a, s) - s, min(b, e) - s, wd, k) for a, b, wd, k in spans if min(b, e) > max(a, s)]
                if not inside:
                    continue
                states = {kind: self._decode(kind, tensors[kind], numel, s, e, scratch)
                          for kind in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)}
                g = grad[s:e]
                for a, b, wd, k in inside:
                    adamw_math(states[StateKind.MASTER][a:b], g[a:b], states[StateKind.EXP_AVG][a:b],
                               states[StateKind.EXP_AVG_SQ][a:b], wd, k, lr, self.config,
                               scratch["t1"][:b - a], scratch["t2"][:b - a])
                for kind, values in states.items():
                    self._encode(kind, values, tensors[kind], numel, s, e, inside, unit, origin, scratch)

    def _decode(self, kind: StateKind, stored: torch.Tensor, numel: int, s: int, e: int,
                scratch: dict[str, torch.Tensor]) -> torch.Tensor:
        """fp32 values of the sub-block [s, e): the stored piece itself where it is fp32."""
        if stored.dtype == torch.float32:
            return stored[s:e]
        out = scratch[kind.value][:e - s]
        if self.formats.quantised(kind):
            absmax, codes = split(stored, numel)
            codes_mod.dequantise(codes[s:e], absmax[s // STATE_BLOCK:codes_mod.nblocks(e)],
                                 kind is StateKind.EXP_AVG, out, self._codes)
        else:
            out.copy_(stored[s:e])
        return out

    def _encode(self, kind: StateKind, values: torch.Tensor, stored: torch.Tensor, numel: int, s: int, e: int,
                inside: list[Span], unit: int, origin: int, scratch: dict[str, torch.Tensor]) -> None:
        if stored.dtype == torch.float32:
            return  # stepped in place
        quantised = self.formats.quantised(kind)
        bits = scratch["bits"][:e - s]
        if sum(b - a for a, b, _, _ in inside) < e - s:
            # values outside the spans were not stepped: they keep their bf16 value (zero bits)
            # or their nearest code (half the gap), which is the code they were decoded from
            bits.fill_(codes_mod.HALF_GAP if quantised else 0)
        for a, b, _, k in inside:
            random_bits(self.config.seed, k + 1, unit, kind, origin + s + a, b - a, scratch, bits[a:b])
        if quantised:
            absmax, codes = split(stored, numel)
            codes_mod.quantise(values, kind is StateKind.EXP_AVG, codes[s:e],
                               absmax[s // STATE_BLOCK:codes_mod.nblocks(e)], self._codes, bits)
        else:
            round_stochastic(values, bits, stored[s:e])


def scratch_nbytes(device_type: str) -> int:
    """Bytes one `CompactStep` allocates on a `device_type` device at its first step and keeps
    (the memory model counts them): fp32 and int32 sub-block buffers, the position offsets, and
    the quantiser's scratch and tables."""
    block = SUB_BLOCK.get(device_type, SUB_BLOCK["cpu"])
    return 4 * block * (len(F32_SCRATCH) + len(INT_SCRATCH) + 1) + codes_mod.Scratch.nbytes(block)


def adamw_math(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, weight_decay: float,
               step: int, lr: float, config: Config, t1: torch.Tensor, t2: torch.Tensor) -> None:
    """torch's AdamW update of fp32 views, in place, as single-rounding elementwise ops; `step`
    updates already applied; `t1`, `t2`: scratch of the views' length."""
    beta1, beta2 = config.betas
    t = step + 1
    if weight_decay:
        p.mul_(1 - lr * weight_decay)
    m.mul_(beta1)
    torch.mul(g, 1 - beta1, out=t1)
    m.add_(t1)
    v.mul_(beta2)
    torch.mul(g, g, out=t1)
    t1.mul_(1 - beta2)
    v.add_(t1)
    torch.sqrt(v, out=t1)
    t1.div_(math.sqrt(1 - beta2 ** t))
    t1.add_(config.eps)
    torch.div(m, t1, out=t2)
    t2.mul_(lr / (1 - beta1 ** t))
    p.sub_(t2)


def stream_key(seed: int, step: int, unit: int, kind: StateKind) -> int:
    """The 32-bit key of one (seed, step, unit, state kind)'s random bits."""
    key = 0
    for part in (seed, step, unit, _KIND_STREAM[kind]):
        key = _mix_int(key ^ (part & _MASK32))
    return key


def _mix_int(h: int) -> int:
    for mult in _MIX:
        h ^= h >> 16
        h = (h * mult) & _MASK32
    return h ^ (h >> 16)


def _int32(x: int) -> int:
    """A 32-bit pattern as the int32 value with the same bits."""
    x &= _MASK32
    return x - (1 << 32) if x >= 1 << 31 else x


def random_bits(seed: int, step: int, unit: int, kind: StateKind, start: int, numel: int,
                scratch: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """16 random bits (int32, 0..65535) per position start..start+numel-1 of a unit's flat buffer.

    Computed in int32 (wrapping mul and add: the bits of uint32 arithmetic), with the logical
    shift `(h >> 16) & 0xFFFF` where int32's arithmetic shift would drag the sign in."""
    shift = scratch["shift"][:numel]
    torch.add(scratch["offsets"][:numel], _int32(start), out=out)
    out.bitwise_xor_(_int32(stream_key(seed, step, unit, kind)))
    for mult in _MIX:
        torch.bitwise_right_shift(out, 16, out=shift).bitwise_and_(0xFFFF)
        out.bitwise_xor_(shift).mul_(mult)
    torch.bitwise_right_shift(out, 16, out=shift)
    out.bitwise_xor_(shift).bitwise_and_(0xFFFF)


def round_stochastic(values: torch.Tensor, bits: torch.Tensor, out: torch.Tensor) -> None:
    """fp32 `values` into bf16 `out`: add 16 random bits below the kept ones and truncate
    (`values` is overwritten). Adding to the magnitude bits rounds away from zero with the
    probability of the discarded fraction, for either sign."""
    raw = values.view(torch.int32)
    raw.add_(bits).bitwise_and_(-65536)
    out.copy_(values)  # exact: the low 16 bits are zero
