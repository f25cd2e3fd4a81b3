"""`CompactStep`: AdamW on one piece whose master or moments are stored compact (bf16, int8).

On the CPU a piece is stepped by a compiled kernel (`cpu_step`, `cpu_kernel`: numba), which
decodes, steps and encodes each quantisation block in one pass on every core; where numba is
missing or fails, and for device tensors, by torch's ops here, which the kernel reproduces
bitwise. These step the piece in sub-blocks of `SUB_BLOCK` values (a multiple of `STATE_BLOCK`,
so each holds whole quantisation blocks): each sub-block's master and moments are decoded into
fp32 scratch, stepped in fp32, and encoded back into the stored piece. The scratch (about 10
MiB, allocated at the first step and reused) is all the fp32 state that ever exists: never a
fp32 copy of a piece, let alone of a unit. fp32 master or moments are stepped in place. A bf16
grad is stepped as its fp32 value.

The formula is torch's AdamW (decoupled weight decay, bias-corrected moments), written as
single-rounding elementwise ops (mul, add, div, sqrt; no fused multiply-add), so a value's
result does not depend on where a sub-block or vector lane cuts: the step equals the same
formula applied to the whole decoded piece in plain PyTorch, bitwise (tests hold this).
torch's own fused kernel rounds differently, which is why fp32 state keeps it instead.

bf16 master weights and bf16 moments are written with stochastic rounding (see docs/design.md,
"Compact optimizer state"): the fp32 result's low 16 bits plus 16 random bits, truncated, rounds up
with probability equal to the discarded fraction, so updates far below a bf16 ulp still move the
weight in expectation. int8 moments round stochastically between the two codes around a value with
the same 16 bits (`codes.quantise`). The random bits are a hash of (seed, step count, unit, state
kind, the value's position in the unit's flat buffer) -- no generator state, so a resumed run draws
the very bits the uninterrupted one would, whatever the piece size.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable

import torch

from tierzero.compact import codes as codes_mod
from tierzero.compact import cpu_step
from tierzero.compact.formats import StateFormats, split
from tierzero.config import STATE_BLOCK, OptimizerSettings, StateKind

# values per sub-block (whole STATE_BLOCKs): fewer, larger ops
SUB_BLOCK = {"cpu": 1 << 18, "cuda": 1 << 18}
F32_SCRATCH = (
    "master",
    "exp_avg",
    "exp_avg_sq",
    "grad",
    "t1",
    "t2",
)  # a sub-block's decoded states, temporaries
INT_SCRATCH = ("shift", "bits")  # stochastic rounding's hash (int32)
_MASK32 = 0xFFFFFFFF
# the moments share one stream: exp_avg rounds by its hash's low 16 bits, exp_avg_sq by its high
_KIND_STREAM = {StateKind.MASTER: 1, StateKind.EXP_AVG: 2, StateKind.EXP_AVG_SQ: 2}

# (start, end) in the piece, weight decay, updates already applied
Span = tuple[int, int, float, int]

log = logging.getLogger(__name__)


def step_scratch(block: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The buffers a sub-block of `block` values is decoded, stepped and encoded in: fp32 ones
    (`F32_SCRATCH`), int32 ones for the random bits (`INT_SCRATCH`), and `offsets`, the positions
    0..block-1 that `random_bits` adds a start to (arange is slow)."""
    f32 = {name: torch.empty(block, dtype=torch.float32, device=device) for name in F32_SCRATCH}
    ints = {name: torch.empty(block, dtype=torch.int32, device=device) for name in INT_SCRATCH}
    offsets = torch.arange(block, dtype=torch.int32, device=device)
    return {**f32, **ints, "offsets": offsets}


class CompactStep:
    def __init__(
        self,
        formats: StateFormats,
        optimizer: OptimizerSettings,
        seed: int,
        device: torch.device,
        kernel: bool | Callable = True,
    ) -> None:
        """`kernel`: True steps CPU pieces with the compiled kernel where it is available
        (`cpu_kernel()`), False always with torch's ops (the fallback, which tests and
        benchmarks compare it with); a callable is the kernel to use (`cpu_kernel` checks one
        so); `seed` draws the stochastic rounding's bits (the run's seed)."""
        self.formats = formats
        self.optimizer = optimizer
        self.seed = seed
        self.device = device
        self.kernel = kernel if device.type == "cpu" else False
        self.block = SUB_BLOCK.get(device.type, SUB_BLOCK["cpu"])
        self._scratch: dict[str, torch.Tensor] | None = None
        self._codes: codes_mod.Scratch | None = None
        # one scratch: the training thread's and the optimizer lane's steps take turns
        self._lock = threading.Lock()

    def _buffers(self) -> dict[str, torch.Tensor]:
        if self._scratch is None:
            self._scratch = step_scratch(self.block, self.device)
            self._codes = codes_mod.Scratch(self.block, self.device)
        return self._scratch

    def step(
        self,
        tensors: dict[StateKind, torch.Tensor],
        spans: list[Span],
        lr: float,
        unit: int,
        origin: int,
    ) -> None:
        """One AdamW update of a piece's `spans` (piece offsets, per-span weight decay and step
        count), in place in the stored `tensors` (master, grad, moments); `origin`: the piece's
        first value's offset in its unit's flat buffer (stochastic rounding's position)."""
        spans = [span for span in spans if span[1] > span[0]]
        run = None
        if self.kernel is not False and cpu_step.usable(tensors):
            run = cpu_kernel() if self.kernel is True else self.kernel
        with self._lock:
            if run is None:
                self._step_torch(tensors, spans, lr, unit, origin)
                return
            scalars = [adamw_scalars(wd, k, lr, self.optimizer) for _, _, wd, k in spans]
            keys = [
                [stream_key(self.seed, k + 1, unit, kind) for kind in cpu_step.STREAMS]
                for _, _, _, k in spans
            ]
            cpu_step.step_piece(
                run, self.formats, tensors, spans, scalars, keys, origin, self.block
            )

    def _step_torch(
        self,
        tensors: dict[StateKind, torch.Tensor],
        spans: list[Span],
        lr: float,
        unit: int,
        origin: int,
    ) -> None:
        """`step` in sub-blocks of torch ops: the fallback, and the path for device tensors."""
        grad = tensors[StateKind.GRAD]
        numel = grad.numel()
        scratch = self._buffers()
        for s in range(0, numel, self.block):
            e = min(s + self.block, numel)
            inside = [
                (max(a, s) - s, min(b, e) - s, wd, k)
                for a, b, wd, k in spans
                if min(b, e) > max(a, s)
            ]
            if not inside:
                continue
            states = {
                kind: self._decode(kind, tensors[kind], numel, s, e, scratch)
                for kind in (StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
            }
            g = self._decode(StateKind.GRAD, grad, numel, s, e, scratch)
            for a, b, wd, k in inside:
                adamw_math(
                    states[StateKind.MASTER][a:b],
                    g[a:b],
                    states[StateKind.EXP_AVG][a:b],
                    states[StateKind.EXP_AVG_SQ][a:b],
                    wd,
                    k,
                    lr,
                    self.optimizer,
                    scratch["t1"][: b - a],
                    scratch["t2"][: b - a],
                )
            for kind, values in states.items():
                self._encode(
                    kind, values, tensors[kind], numel, s, e, inside, unit, origin, scratch
                )

    def _decode(
        self,
        kind: StateKind,
        stored: torch.Tensor,
        numel: int,
        s: int,
        e: int,
        scratch: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """fp32 values of the sub-block [s, e): the stored piece itself where it is fp32."""
        if stored.dtype == torch.float32:
            return stored[s:e]
        out = scratch[kind.value][: e - s]
        if self.formats.quantised(kind):
            scales, codes = split(stored, numel)
            codes_mod.dequantise(
                codes[s:e],
                scales[s // STATE_BLOCK : codes_mod.nblocks(e)],
                kind is StateKind.EXP_AVG,
                out,
                self._codes,
            )
        else:
            out.copy_(stored[s:e])
        return out

    def _encode(
        self,
        kind: StateKind,
        values: torch.Tensor,
        stored: torch.Tensor,
        numel: int,
        s: int,
        e: int,
        inside: list[Span],
        unit: int,
        origin: int,
        scratch: dict[str, torch.Tensor],
    ) -> None:
        if stored.dtype == torch.float32:
            return  # stepped in place
        quantised = self.formats.quantised(kind)
        bits = scratch["bits"][: e - s]
        if sum(b - a for a, b, _, _ in inside) < e - s:
            # values outside the spans were not stepped: they keep their bf16 value (zero bits)
            # or their nearest code (half the gap), which is the code they were decoded from
            bits.fill_(codes_mod.HALF_GAP if quantised else 0)
        for a, b, _, k in inside:
            random_bits(self.seed, k + 1, unit, kind, origin + s + a, b - a, scratch, bits[a:b])
        if quantised:
            scales, codes = split(stored, numel)
            codes_mod.quantise(
                values,
                kind is StateKind.EXP_AVG,
                codes[s:e],
                scales[s // STATE_BLOCK : codes_mod.nblocks(e)],
                self._codes,
                bits,
            )
        else:
            round_stochastic(values, bits, stored[s:e])


@functools.cache
def cpu_kernel() -> Callable | None:
    """numba's compiled kernel (`cpu_step.load`), checked against torch's ops on a probe piece;
    None, said once in the log, where it cannot be had: numba missing, its compiler failing, or
    its results differing from torch's ops on this machine."""
    try:
        run = cpu_step.load()
        _check(run)
    except Exception as error:  # noqa: BLE001 -- whatever numba raises: the torch ops still step
        log.warning(
            "the compact optimizer step's CPU kernel is unavailable (%s: %s); stepping "
            "with torch's ops instead, about 10x slower",
            type(error).__name__,
            error,
        )
        return None
    return run


class KernelMismatch(RuntimeError):
    """The compiled kernel does not reproduce torch's ops bitwise on this machine."""


def _check(run: Callable) -> None:
    """Step a probe piece with `run` and with torch's ops; raise `KernelMismatch` unless they
    agree. An fp32 master shows any difference in sqrt or division, int8 moments the coder's."""
    formats, settings = (
        StateFormats(moments="int8", master="fp32"),
        OptimizerSettings(weight_decay=0.1),
    )
    numel, spans = 3 * STATE_BLOCK + 77, [(0, 300, 0.1, 0), (400, 3 * STATE_BLOCK + 77, 0.0, 4)]
    g = torch.Generator().manual_seed(0)
    values = {
        StateKind.MASTER: torch.randn(numel, generator=g),
        StateKind.EXP_AVG: torch.randn(numel, generator=g) * 1e-3,
        StateKind.EXP_AVG_SQ: torch.rand(numel, generator=g) * 1e-6,
    }
    probe = {kind: formats.encode(kind, v) for kind, v in values.items()}
    probe[StateKind.GRAD] = torch.randn(numel, generator=g) * 1e-2
    fast = {kind: t.clone() for kind, t in probe.items()}
    CompactStep(formats, settings, 0, torch.device("cpu"), kernel=False).step(
        probe, spans, 1e-3, 0, 0
    )
    CompactStep(formats, settings, 0, torch.device("cpu"), kernel=run).step(fast, spans, 1e-3, 0, 0)
    if not all(torch.equal(probe[kind], fast[kind]) for kind in probe):
        raise KernelMismatch("its results differ from torch's ops on this machine")


def scratch_nbytes(device_type: str) -> int:
    """Bytes one `CompactStep` allocates on a `device_type` device at its first step and keeps
    (the memory model counts them): fp32 and int32 sub-block buffers, the position offsets, and
    the quantiser's scratch and tables; on the CPU, where numba is installed, the kernel's
    (`cpu_step.scratch_nbytes`: the torch ops' scratch is then allocated only if it fails)."""
    if device_type == "cpu" and cpu_step.installed():
        return cpu_step.scratch_nbytes()
    block = SUB_BLOCK.get(device_type, SUB_BLOCK["cpu"])
    return 4 * block * (len(F32_SCRATCH) + len(INT_SCRATCH) + 1) + codes_mod.Scratch.nbytes(block)


def adamw_scalars(
    weight_decay: float, step: int, lr: float, optimizer: OptimizerSettings
) -> tuple[float, ...]:
    """The Python floats `adamw_math` multiplies, divides and adds by, in one place for both
    paths (torch converts each to fp32 before its op; the CPU kernel is handed them so):
    decay factor, beta1, 1 - beta1, beta2, 1 - beta2, the root of the second moment's bias
    correction, eps, and the step size lr / (first moment's bias correction)."""
    beta1, beta2 = optimizer.betas
    t = step + 1
    return (
        1 - lr * weight_decay,
        beta1,
        1 - beta1,
        beta2,
        1 - beta2,
        math.sqrt(1 - beta2**t),
        optimizer.eps,
        lr / (1 - beta1**t),
    )


def adamw_math(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    weight_decay: float,
    step: int,
    lr: float,
    optimizer: OptimizerSettings,
    t1: torch.Tensor,
    t2: torch.Tensor,
) -> None:
    """torch's AdamW update of fp32 views, in place, as single-rounding elementwise ops; `step`
    updates already applied; `t1`, `t2`: scratch of the views' length."""
    decay, beta1, one_minus_beta1, beta2, one_minus_beta2, root, eps, step_size = adamw_scalars(
        weight_decay, step, lr, optimizer
    )
    if weight_decay:
        p.mul_(decay)
    m.mul_(beta1)
    torch.mul(g, one_minus_beta1, out=t1)
    m.add_(t1)
    v.mul_(beta2)
    torch.mul(g, g, out=t1)
    t1.mul_(one_minus_beta2)
    v.add_(t1)
    ieee_sqrt(v, out=t1)
    t1.div_(root)
    t1.add_(eps)
    torch.div(m, t1, out=t2)
    t2.mul_(step_size)
    p.sub_(t2)


def ieee_sqrt(v: torch.Tensor, out: torch.Tensor) -> None:
    """fp32 `out` = the correctly rounded sqrt of fp32 `v`, as the CPU kernel's (and CUDA's)
    sqrt computes it. torch's fp32 sqrt on the CPU is MKL's where torch has MKL, an ulp off on
    about a fifth of values; the sqrt of the fp64 value, rounded to fp32, is the correctly
    rounded one (a sqrt of a 24-bit float is never within 2**-53 of a midpoint between fp32s)."""
    if v.device.type == "cpu":
        out.copy_(torch.sqrt(v.double()))
    else:
        torch.sqrt(v, out=out)


def stream_key(seed: int, step: int, unit: int, kind: StateKind) -> int:
    """The 32-bit key of one (seed, step, unit, state kind)'s random bits."""
    key = 0
    for part in (seed, step, unit, _KIND_STREAM[kind]):
        key = _mix_int(key ^ (part & _MASK32))
    return key


def _mix_int(h: int) -> int:
    for mult in codes_mod.MIX:
        h ^= h >> 16
        h = (h * mult) & _MASK32
    return h ^ (h >> 16)


def _int32(x: int) -> int:
    """A 32-bit pattern as the int32 value with the same bits."""
    x &= _MASK32
    return x - (1 << 32) if x >= 1 << 31 else x


def random_bits(
    seed: int,
    step: int,
    unit: int,
    kind: StateKind,
    start: int,
    numel: int,
    scratch: dict[str, torch.Tensor],
    out: torch.Tensor,
) -> None:
    """16 random bits (int32, 0..65535) per position start..start+numel-1 of a unit's flat buffer:
    the low half of a 32-bit hash of the position, the high half for exp_avg_sq (whose stream
    is exp_avg's: one hash rounds both moments).

    Computed in int32 (wrapping mul and add: the bits of uint32 arithmetic), with the logical
    shift `(h >> 16) & 0xFFFF` where int32's arithmetic shift would drag the sign in."""
    shift = scratch["shift"][:numel]
    torch.add(scratch["offsets"][:numel], _int32(start), out=out)
    out.bitwise_xor_(_int32(stream_key(seed, step, unit, kind)))
    for mult in codes_mod.MIX:
        torch.bitwise_right_shift(out, 16, out=shift).bitwise_and_(0xFFFF)
        out.bitwise_xor_(shift).mul_(mult)
    torch.bitwise_right_shift(out, 16, out=shift).bitwise_and_(0xFFFF)
    out.bitwise_xor_(shift)
    if kind is StateKind.EXP_AVG_SQ:
        out.bitwise_right_shift_(16)
    out.bitwise_and_(0xFFFF)


def round_stochastic(values: torch.Tensor, bits: torch.Tensor, out: torch.Tensor) -> None:
    """fp32 `values` into bf16 `out`: add 16 random bits below the kept ones and truncate
    (`values` is overwritten). Adding to the magnitude bits rounds away from zero with the
    probability of the discarded fraction, for either sign."""
    raw = values.view(torch.int32)
    raw.add_(bits).bitwise_and_(-65536)
    out.copy_(values)  # exact: the low 16 bits are zero
