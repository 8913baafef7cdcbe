"""The numba twins of state_formats.py's moment codecs: scalar intrinsics the compact AdamW kernels
inline (slide_core/optim/compact_adamw.py), each the torch twin operation for operation, so given the same
fp32 moments they give the same codes (tested bit for bit). Importing this module imports no numba;
:func:`numba_twins` does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import numpy as np

from slide_core.optim.state_formats import _M1, _M2

if TYPE_CHECKING:
    from numba.core import types
    from numba.core.typing.context import BaseContext
    from numba.core.typing.templates import Signature

__all__ = ["Codegen", "NumbaTwins", "Typing", "numba_twins"]

Codegen: TypeAlias = "Callable[[Any, Any, Signature, Sequence[Any]], Any]"
"""An intrinsic's code generator: (numba's target context, an llvmlite ``IRBuilder``, the call's signature,
its LLVM argument values) -> the LLVM result. Any where the callee is untyped: llvmlite ships no type
information and numba's target context is unannotated."""

Typing: TypeAlias = "tuple[Signature, Codegen] | None"
"""What an ``@intrinsic`` definition returns for its argument types: the signature and code generator it
lowers to, or None where it does not apply (numba then reports a typing error)."""

# The intrinsics as jitted code calls them (numba's stub types an ``_Intrinsic``'s call with its definition's
# parameters, the typing context included, so these are cast from it once, in ``numba_twins``).
Hash32: TypeAlias = Callable[[np.uint32, int, np.uint32, np.uint32], np.uint32]
High16: TypeAlias = Callable[[np.uint32], np.uint32]
SrBf16: TypeAlias = Callable[[np.float32, np.uint32], np.uint16]
AbsBits: TypeAlias = Callable[[np.float32], np.uint32]
EncodeM8: TypeAlias = Callable[[np.float32, np.float32, np.uint32], np.int8]
EncodeV8: TypeAlias = Callable[[np.float32, np.float32, np.uint32], np.uint8]
DecodeM8: TypeAlias = Callable[[np.int8, np.float32], np.float32]
DecodeV8: TypeAlias = Callable[[np.uint8, np.float32], np.float32]


# Written as LLVM IR, not as numba Python: numba widens every integer operation to 64 bits, and the hash's
# 32-bit multiplies then run as 64-bit vector multiplies in half as many lanes (measured ~1.7x slower per
# element than the 32-bit lanes below). Each intrinsic is its torch twin in state_formats.py, op for op.


@dataclass(frozen=True)
class NumbaTwins:
    """The intrinsics (numba ``@intrinsic`` objects, callable from jitted code only).

    - ``hash32(lo0, j, hi_key, k0) -> uint32``: :func:`element_bits` of index ``lo0 + j + 2^32 hi`` with
      ``hi_key = hi ^ k1`` (``lo0``/``hi`` uint32 halves of a run's first index, ``j`` intp). The run must
      not carry into the high half (``lo0 + j < 2^32`` for every ``j``): callers split a run where it
      would (:func:`slide_core.optim.compact_adamw._hash_run`), so the high half's term is one constant
      per run instead of a per-element unsigned compare, add and xor.
    - ``high16(h) -> uint32``: ``h >> 16`` (exp_avg_sq's random bits).
    - ``sr_bf16(x, rand) -> uint16``: ``_sr_bf16_t`` of fp32 ``x`` with the low 16 bits of ``rand``.
    - ``abs_bits(x) -> uint32``: the bits of ``|x|``; for non-negative floats their order is the values'
      order, so a block maximum is an integer max (which vectorises; a float max reduction does not
      without fast-math).
    - ``encode_m8(x, inv, rand) -> int8`` / ``encode_v8(x, inv, rand) -> uint8``: ``_encode_int8_t`` of
      ``x`` given ``inv`` = 1 / its block's scale (0 for an all-zero block; never negative, which the
      code's range test relies on).
    - ``decode_m8(code, scale)`` / ``decode_v8(code, scale) -> float32``: ``_decode_int8_t``.
    """

    hash32: Hash32
    high16: High16
    sr_bf16: SrBf16
    abs_bits: AbsBits
    encode_m8: EncodeM8
    encode_v8: EncodeV8
    decode_m8: DecodeM8
    decode_v8: DecodeV8


@functools.cache
def numba_twins() -> NumbaTwins:
    """Build the intrinsics (imports numba and llvmlite)."""
    from llvmlite import ir  # type: ignore[import-untyped]  # llvmlite ships no type information
    from numba.core import types
    from numba.extending import intrinsic

    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()

    def c(value: int) -> ir.Constant:
        return ir.Constant(i32, value)

    def cf(value: float) -> ir.Constant:
        return ir.Constant(f32, value)

    def mix(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
        x = b.xor(x, b.lshr(x, c(16)))
        x = b.mul(x, c(_M1))
        x = b.xor(x, b.lshr(x, c(15)))
        x = b.mul(x, c(_M2))
        return b.xor(x, b.lshr(x, c(16)))

    @intrinsic
    def hash32(typingctx: BaseContext, lo0: types.Type, j: types.Type, hi_key: types.Type, k0: types.Type) -> Typing:
        def codegen(context: Any, b: ir.IRBuilder, signature: Signature, args: Sequence[ir.Value]) -> ir.Value:
            lo0, j, hi_key, k0 = args
            lo = b.add(lo0, b.trunc(j, i32))  # no carry into the high half: the caller's contract
            return mix(b, b.xor(mix(b, b.xor(lo, k0)), hi_key))

        return types.uint32(types.uint32, types.intp, types.uint32, types.uint32), codegen

    @intrinsic
    def high16(typingctx: BaseContext, h: types.Type) -> Typing:
        def codegen(context: Any, b: ir.IRBuilder, signature: Signature, args: Sequence[ir.Value]) -> ir.Value:
            return b.lshr(args[0], c(16))

        return types.uint32(types.uint32), codegen

    @intrinsic
    def sr_bf16(typingctx: BaseContext, x: types.Type, rand: types.Type) -> Typing:
        def codegen(context: Any, b: ir.IRBuilder, signature: Signature, args: Sequence[ir.Value]) -> ir.Value:
            u = b.bitcast(args[0], i32)
            trunc = b.lshr(u, c(16))
            up = b.lshr(b.add(u, b.and_(args[1], c(0xFFFF))), c(16))
            special = b.icmp_unsigned("==", b.and_(u, c(0x7F800000)), c(0x7F800000))
            overflow = b.icmp_unsigned("==", b.and_(up, c(0x7F80)), c(0x7F80))
            nan = b.icmp_unsigned(">", b.and_(u, c(0x7FFFFFFF)), c(0x7F800000))
            out = b.select(b.or_(special, overflow), trunc, up)
            return b.trunc(b.select(nan, b.or_(trunc, c(0x40)), out), i16)

        return types.uint16(types.float32, types.uint32), codegen

    @intrinsic
    def abs_bits(typingctx: BaseContext, x: types.Type) -> Typing:
        def codegen(context: Any, b: ir.IRBuilder, signature: Signature, args: Sequence[ir.Value]) -> ir.Value:
            return b.and_(b.bitcast(args[0], i32), c(0x7FFFFFFF))

        return types.uint32(types.float32), codegen

    def encode(mantissa_bits: int, signed: bool) -> Codegen:
        shift = 23 - mantissa_bits

        def codegen(context: Any, b: ir.IRBuilder, signature: Signature, args: Sequence[ir.Value]) -> ir.Value:
            x, inv, rand = args
            magnitude = b.bitcast(b.and_(b.bitcast(x, i32), c(0x7FFFFFFF)), f32)
            r = b.fmul(magnitude, inv)
            r = b.select(b.fcmp_ordered(">", r, cf(1.0)), cf(1.0), r)
            u = b.bitcast(r, i32)
            rand16 = b.and_(rand, c(0xFFFF))
            normal = b.sub(b.lshr(b.add(u, b.shl(rand16, c(shift - 16))), c(shift)), c(112 << mantissa_bits))
            small = b.select(b.fcmp_ordered("<", r, cf(2.0**-14)), r, cf(2.0**-14))  # only used below 2^-14
            # small is in [0, 2^-14] (r >= +0 or NaN, and NaN takes 2^-14), so the product is at most
            # 2^(mantissa_bits + 16) < 2^31, where a signed conversion equals the unsigned one: AVX2 has
            # the signed one only (fptoui costs four more instructions per lane group).
            fixed = b.fptosi(b.fmul(small, cf(2.0 ** (14 + mantissa_bits + 16))), i32)
            low = b.lshr(b.add(fixed, rand16), c(16))
            if not signed:  # exp_avg_sq: a positive value never rounds to zero
                positive = b.fcmp_ordered(">", x, cf(0.0))
                low = b.select(b.and_(positive, b.icmp_unsigned("==", low, c(0))), c(1), low)
            # ``u >= bits(2^-14)`` as unsigned integers, compared as floats: ``inv`` is >= 0 (1 / a
            # block's largest magnitude, +Inf for the smallest subnormal ones, or 0), so ``r`` is +0, positive or
            # NaN, where the two orders agree and "not below" takes NaN (of either sign, as the unsigned
            # compare does) to ``normal``. AVX2 compares only signed integers; one float compare
            # replaces the max-and-equal pair an unsigned compare lowers to.
            code = b.select(b.fcmp_unordered(">=", r, cf(2.0**-14)), normal, low)
            if signed:
                code = b.select(b.fcmp_ordered("<", x, cf(0.0)), b.neg(code), code)
            return b.trunc(code, i8)

        return codegen

    @intrinsic
    def encode_m8(typingctx: BaseContext, x: types.Type, inv: types.Type, rand: types.Type) -> Typing:
        return types.int8(types.float32, types.float32, types.uint32), encode(3, signed=True)

    @intrinsic
    def encode_v8(typingctx: BaseContext, x: types.Type, inv: types.Type, rand: types.Type) -> Typing:
        return types.uint8(types.float32, types.float32, types.uint32), encode(4, signed=False)

    def decode(mantissa_bits: int, signed: bool) -> Codegen:
        def codegen(context: Any, b: ir.IRBuilder, signature: Signature, args: Sequence[ir.Value]) -> ir.Value:
            code, scale = args
            if signed:
                wide = b.sext(code, i32)
                negative = b.icmp_signed("<", wide, c(0))
                magnitude = b.select(negative, b.neg(wide), wide)
            else:
                magnitude = b.zext(code, i32)
            bits = b.shl(b.add(magnitude, c(112 << mantissa_bits)), c(23 - mantissa_bits))
            small = b.fmul(b.uitofp(magnitude, f32), cf(2.0 ** -(14 + mantissa_bits)))
            # ``magnitude >= 2^mantissa_bits`` (a normal code), tested on the value it decodes to: for
            # every magnitude a code has (0..128 signed, 0..255 unsigned) that value is finite, and it is
            # at least 2^-14 exactly for the normal ones. LLVM narrows an integer compare of the widened
            # byte back to byte lanes and widens the mask again (four instructions); the float compare is one.
            normal = b.bitcast(bits, f32)
            r = b.select(b.fcmp_ordered(">=", normal, cf(2.0**-14)), normal, small)
            value = b.fmul(r, scale)
            return b.select(negative, b.fneg(value), value) if signed else value

        return codegen

    @intrinsic
    def decode_m8(typingctx: BaseContext, code: types.Type, scale: types.Type) -> Typing:
        return types.float32(types.int8, types.float32), decode(3, signed=True)

    @intrinsic
    def decode_v8(typingctx: BaseContext, code: types.Type, scale: types.Type) -> Typing:
        return types.float32(types.uint8, types.float32), decode(4, signed=False)

    # Jitted code calls an intrinsic without its typing context, which numba's stub cannot express.
    return NumbaTwins(
        cast(Hash32, hash32),
        cast(High16, high16),
        cast(SrBf16, sr_bf16),
        cast(AbsBits, abs_bits),
        cast(EncodeM8, encode_m8),
        cast(EncodeV8, encode_v8),
        cast(DecodeM8, decode_m8),
        cast(DecodeV8, decode_v8),
    )
