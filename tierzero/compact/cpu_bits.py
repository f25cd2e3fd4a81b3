"""The CPU kernel's bit-level steps, as 32-bit LLVM instructions.

numba types arithmetic on uint32 as uint64, so a loop of it vectorises to 8 lanes of 64-bit
integers with a widening and a narrowing per value: measured 0.5 ns a value for coding an int8
moment. Written here with llvmlite's builder, each step stays in 16 lanes of 32 bits. Each is
the operation of `tierzero.compact.step` or `tierzero.compact.codes` that its docstring names,
with fp32 arithmetic that rounds as theirs (no fast-math flags: IEEE multiply and add).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from tierzero.compact import codes as codes_mod

ABS = 0x7FFFFFFF
I32, F32 = ir.IntType(32), ir.FloatType()


def _i32(value: int) -> ir.Constant:
    return ir.Constant(I32, value)


def _umin(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    return builder.select(builder.icmp_unsigned("<", a, b), a, b)


def _umax(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    return builder.select(builder.icmp_unsigned(">", a, b), a, b)


@intrinsic
def mix(typingctx, h):
    """`step._mix_int`'s rounds on a uint32: 32 random bits, 16 for each of two states."""

    def codegen(context, builder, signature, args):
        (h,) = args
        for mult in codes_mod.MIX:
            h = builder.xor(h, builder.lshr(h, _i32(16)))
            h = builder.mul(h, _i32(mult))
        return builder.xor(h, builder.lshr(h, _i32(16)))

    return types.uint32(types.uint32), codegen


def _half(builder: ir.IRBuilder, bits: ir.Value, shift: ir.Value) -> ir.Value:
    """The 16 random bits of a state: `bits` shifted right by `shift` (0 or 16), masked."""
    return builder.and_(builder.lshr(bits, shift), _i32(0xFFFF))


@intrinsic
def as_float(typingctx, bits):
    """A uint32's bits as an fp32."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], F32)

    return types.float32(types.uint32), codegen


@intrinsic
def round_bf16(typingctx, x, bits, shift):
    """`step.round_stochastic` of one value: fp32 bits `x` plus 16 random bits (`_half`),
    truncated to bf16's bits; a NaN after it as 0xFFFF (what torch's fp32 -> bf16 copy stores
    for any)."""

    def codegen(context, builder, signature, args):
        x, bits, shift = args
        bits = _half(builder, bits, shift)
        rounded = builder.and_(builder.add(x, bits), _i32(-65536))
        nan = builder.icmp_unsigned(">", builder.and_(rounded, _i32(ABS)), _i32(codes_mod.INF_BITS))
        kept = builder.lshr(rounded, _i32(16))
        return builder.trunc(builder.select(nan, _i32(0xFFFF), kept), ir.IntType(16))

    return types.uint16(types.uint32, types.uint32, types.uint32), codegen


@intrinsic
def widen_bf16(typingctx, b16):
    """A bf16's bits as the fp32 it is."""

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], I32), _i32(16))
        return builder.bitcast(wide, F32)

    return types.float32(types.uint16), codegen


def _coder(signed: bool):
    """`codes.quantise` of one value: its code, from its fp32 bits `x`, 16 random bits (`_half`) and
    its block's `inverse` scale (a block below `codes.TINY` is lifted before: `x` is then its lifted
    value)."""
    mask, offset = codes_mod.magnitude_mask(signed), codes_mod.offset(signed)
    least = ir.Constant(F32, codes_mod.smallest_binade(signed))

    @intrinsic
    def code(typingctx, x, bits, shift, inverse):
        def codegen(context, builder, signature, args):
            x, bits, shift, inverse = args
            y = builder.fmul(builder.bitcast(builder.and_(x, _i32(ABS)), F32), inverse)
            # below the smallest binade the code is linear: y plus that binade is coded as the
            # binades are, less the binade's own code (its bits' low DROP are zero, so this is
            # the linear code exactly)
            tiny = builder.fcmp_ordered("<", y, least)
            z = builder.bitcast(builder.select(tiny, builder.fadd(y, least), y), I32)
            below = builder.select(tiny, _i32(offset + codes_mod.LINEAR), _i32(offset))
            # the bits plus the random ones, shifted, less the offset; a NaN (any sign or
            # payload) wraps or lands past the top code, which it is clamped to, as torch's
            # ops code it
            r = builder.shl(_half(builder, bits, shift), _i32(codes_mod.DROP - 16))
            shifted = builder.lshr(builder.add(z, r), _i32(codes_mod.DROP))
            result = _umin(builder, builder.sub(shifted, below), _i32(mask))
            if signed:
                sign = builder.and_(builder.lshr(x, _i32(24)), _i32(codes_mod.SIGN))
                return builder.or_(result, sign)
            # a positive exp_avg_sq is never code 0
            positive = builder.fcmp_ordered(">", builder.bitcast(x, F32), ir.Constant(F32, 0.0))
            return _umax(builder, result, builder.zext(positive, I32))

        signature = types.uint32(types.uint32, types.uint32, types.uint32, types.float32)
        return signature, codegen

    return code


def _valuer(signed: bool):
    """`codes.code_map(signed)[code]`: a code's value, before its block's scale."""
    mask, offset = codes_mod.magnitude_mask(signed), codes_mod.offset(signed)
    step = codes_mod.smallest_binade(signed) / codes_mod.LINEAR

    @intrinsic
    def value(typingctx, code):
        def codegen(context, builder, signature, args):
            code = builder.zext(args[0], I32)
            magnitude = builder.and_(code, _i32(mask))
            binade = builder.shl(builder.add(magnitude, _i32(offset)), _i32(codes_mod.DROP))
            linear = builder.fmul(builder.uitofp(magnitude, F32), ir.Constant(F32, step))
            small = builder.icmp_unsigned("<", magnitude, _i32(codes_mod.LINEAR))
            result = builder.select(small, builder.bitcast(linear, I32), binade)
            if signed:
                sign = builder.shl(builder.and_(code, _i32(codes_mod.SIGN)), _i32(24))
                result = builder.or_(result, sign)
            return builder.bitcast(result, F32)

        return types.float32(types.uint8), codegen

    return value


code_signed, code_unsigned = _coder(True), _coder(False)
value_signed, value_unsigned = _valuer(True), _valuer(False)
