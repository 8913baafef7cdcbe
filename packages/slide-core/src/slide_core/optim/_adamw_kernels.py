"""The numba kernels of the host AdamW: one fused, multi-threaded pass over a flat range, for the update
(``FusedAdamW``, and ``CompactAdamW``'s element arithmetic) and for clipping's correction (``AdamWCorrection``).

They live apart from the optimizer classes so that the correction (used by every AdamW) and the optimizers
import them without importing one another.

The arithmetic is ``torch.optim.AdamW(foreach=False)``'s, op for op, in fp32, with the scalars computed
in Python float64 and rounded to fp32 exactly where torch rounds them:

    g  = f32(grad) * f32(grad_scale)                     # scale_into's copy_ + mul_ (exact at 1)
    p  = p * f32(1 - lr*wd)                              # mul_ (only when decaying)
    m  = fma(c, g - m, m if w < .5 else g)               # lerp_(g, w), w = 1 - beta1; c = w or w - 1
    v  = fma(f32(1 - beta2) * g, g, v * f32(beta2))      # mul_(beta2).addcmul_(g, g, value=1 - beta2)
    d  = sqrt(v) / f32(sqrt(1 - beta2**t)) + f32(eps)
    p  = p + (f32(-lr / (1 - beta1**t)) * m) / d         # addcdiv_(m, d, value=-step_size)

The two fused multiply-adds are there because torch's CPU kernels have them: ``lerp`` calls
``vec::fmadd`` explicitly and GCC contracts ``addcmul``'s ``self + value*t1*t2``; with them exp_avg and
exp_avg_sq come out bit-identical to torch's on AVX2/AVX512 builds. ``p`` can still differ by an ulp of
the update: torch's ``sqrt`` on x86 goes through MKL VML in high-accuracy mode (< 1 ulp, not correctly
rounded), while this kernel's ``sqrt`` is the IEEE one.

A split master (slide_core/split_master.py: the bf16 plane the device is sent, the low 16 bits, a tie
bit per element) goes through the ``*_split`` kernels: the same element arithmetic between
``_load_master`` (decode in registers) and ``_store_master`` (encode), and the same 26 bytes per parameter
(hi and lo read and written instead of the fp32 word), plus the tie bits of the rare midpoints. The decoded
master and the moments are bit for bit those of the fp32 kernel.

A split master (slide_core/split_master.py: the bf16 plane the device is sent, the low 16 bits, a tie
bit per element) goes through the ``*_split`` kernels: the same element arithmetic between
``_load_master`` (decode in registers) and ``_store_master`` (encode), and the same 26 bytes per parameter
(hi and lo read and written instead of the fp32 word), plus the tie bits of the rare midpoints. The decoded
master and the moments are bit for bit those of the fp32 kernel. Which kernel a range takes is its format's
(``Kernels.step[master.format]``), and its operands are its own (``MasterRange.kernel_operands``).

numba is optional: nothing here imports it until a kernel is first needed (:func:`kernels`), and
``import slide_core`` never does.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

import numpy as np
import torch
from numpy.typing import NDArray

from slide_core.master_store import MasterFormat, MasterRange, as_master_range
from slide_core.optim.adamw_config import AdamWConfig
from slide_core.split_master import TIE_BLOCK, kernel_array

if TYPE_CHECKING:
    from numba.core import types
    from numba.core.typing.context import BaseContext
    from numba.core.typing.templates import Signature

    from slide_core.optim._moment_intrinsics import Typing

__all__ = [
    "BLOCK",
    "Kernels",
    "RangeKernel",
    "fused_correct",
    "grad_array",
    "kernels",
    "numba_available",
    "step_scalars",
]

BLOCK = TIE_BLOCK
"""Elements per parallel work item: ~4k items per 16M range, plenty to balance 16 threads, and each
item's five streams stay short enough for the hardware prefetchers to follow."""

_compile_lock = threading.Lock()

Fp32Array: TypeAlias = NDArray[np.float32]
Uint16Array: TypeAlias = NDArray[np.uint16]
"""bf16 values, or a split master's halves, as raw 16-bit words."""
Uint8Array: TypeAlias = NDArray[np.uint8]
GradArray: TypeAlias = NDArray[np.float32] | NDArray[np.uint16]
"""A gradient as the kernels read it: fp32, or bf16 as raw 16-bit words (:func:`grad_array`)."""

RangeKernel: TypeAlias = Callable[..., None]
"""A compiled kernel over one range. Its leading operands are its master format's
(``MasterRange.kernel_operands``), so a dispatch table of them types only the result."""


@dataclass(frozen=True)
class Kernels:
    """What :func:`kernels` returns: the compiled kernels by master format, and numba's thread controls."""

    step: Mapping[MasterFormat, RangeKernel]
    """The update (``_adamw_py`` / ``_adamw_split_py``), by ``MasterRange.format``."""
    correction: Mapping[MasterFormat, RangeKernel]
    """Clipping's correction (``_correct_py`` / ``_correct_split_py``), by ``MasterRange.format``."""
    set_num_threads: Callable[[int], None]
    get_num_threads: Callable[[], int]
    max_threads: int
    """numba's thread pool size (``NUMBA_NUM_THREADS``), the most ``set_num_threads`` takes."""


_Fn = TypeVar("_Fn", bound=Callable[..., object])


def _as_stand_in(compiled: object, stand_in: _Fn) -> _Fn:
    """A numba intrinsic typed as the pure-Python stand-in it replaces: jitted code calls it with the
    stand-in's arguments, but numba's stub types an intrinsic's call with its definition's parameters
    (the typing context first), which no annotation can turn into the call jitted code makes."""
    return cast(_Fn, compiled)


@functools.cache
def numba_available() -> bool:
    """Whether numba imports here (nothing is compiled by asking)."""
    try:
        import numba  # noqa: F401
    except Exception:  # ImportError, or a numba/llvmlite/numpy version mismatch raising on import
        return False
    return True


# The kernel, as plain Python until ``_kernels`` compiles it. It lives at module level (not in a closure)
# so numba's on-disk cache can key it by file and name: a closure over jitted helpers gets a fresh cache
# key, and a fresh cache file, in every process. ``_fma32``, ``_as_fp32``, ``_update_block`` and
# ``_prange`` are rebound to numba objects by ``_kernels`` before the first compile; until then they are
# pure-Python stand-ins that only document what the compiled versions do.


def _fma32_py(a: np.float32, b: np.float32, c: np.float32) -> np.float32:  # pragma: no cover - replaced
    """fp32 ``a*b + c`` with one rounding (replaced by an llvm.fma intrinsic)."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


_fma32 = _fma32_py


def _as_fp32_py(x: np.float32 | np.uint16) -> np.float32:  # pragma: no cover - replaced by an intrinsic
    """A gradient element as fp32: a bf16's raw uint16 bits are the top half of the fp32's (exact)."""
    if isinstance(x, np.uint16):
        return np.float32(np.array(np.uint32(x) << np.uint32(16)).view(np.float32)[()])
    return np.float32(x)


_as_fp32 = _as_fp32_py


_prange = range


# The split master (slide_core/split_master.py): ``hi`` and ``lo`` as uint16 words, the tie bitmask as
# bytes. These two helpers are the whole per-element format; a kernel over a split master calls them
# where an fp32 kernel reads ``p[j]`` and writes it back, and ``_read_ties`` / ``_write_ties`` around
# its block loop move the rare tie bits between the bitmask and one byte per element.


# ``_decode_py`` and ``_encode_py`` are replaced by intrinsics (i32 ops, one vector lane each).
def _decode_py(h: np.uint16, lo: np.uint16, tie: np.uint8) -> np.float32:  # pragma: no cover - replaced
    """The fp32 whose upper 16 bits are ``h`` minus the rounding that went up (``lo > 0x8000``, or ``lo
    == 0x8000`` and ``tie``) and whose low 16 bits are ``lo``."""
    up = int(lo) > 0x8000 or (int(lo) == 0x8000 and int(tie) & 1 == 1)
    bits = (((int(h) - up) & 0xFFFF) << 16) | int(lo)
    return np.float32(np.array(np.uint32(bits)).view(np.float32)[()])


def _encode_py(x: np.float32) -> tuple[np.uint16, np.uint16, np.uint8]:  # pragma: no cover - replaced
    """(hi, lo, tie) of one fp32: hi its bf16 round-to-nearest-even (torch's cast; a NaN becomes the
    quiet NaN 0x7FC0), lo its low 16 bits, tie 1 iff the rounding went up."""
    bits = int(np.array(np.float32(x)).view(np.uint32)[()])
    upper = bits >> 16
    h = 0x7FC0 if x != x else ((bits + 0x7FFF + (upper & 1)) >> 16) & 0xFFFF
    return np.uint16(h), np.uint16(bits & 0xFFFF), np.uint8(h != upper)


_decode = _decode_py
_encode = _encode_py


def _load_master_py(h: np.uint16, lo: np.uint16, tie: np.uint8) -> np.float32:
    """One element of a split master as fp32 (``tie`` is looked at only when ``lo`` is 0x8000)."""
    return _decode(h, lo, tie)


_load_master = _load_master_py


def _store_master_py(x: np.float32) -> tuple[np.uint16, np.uint16, np.uint8]:
    """One fp32 value as the split master's (hi, lo, tie) of it (``tie`` matters only when lo is 0x8000)."""
    return _encode(x)


_store_master = _store_master_py


def _read_ties_py(lo: Uint16Array, ties: Uint8Array, first: int, flags: Uint8Array) -> None:
    """``flags[j]`` = tie bit ``first + j`` for the block's midpoint elements (``lo[j] == 0x8000``); the
    other flags are left undefined, and ``_load_master`` never looks at them. One vectorised scan of
    ``lo`` (which the block's loop then finds in L1); the bitmask is read only in the ~6% of blocks of
    4096 elements that hold a midpoint."""
    mids = 0
    for j in range(lo.shape[0]):
        mids += lo[j] == 0x8000
    if mids:
        for j in range(lo.shape[0]):
            if lo[j] == 0x8000:
                k = first + j
                flags[j] = (ties[k >> 3] >> (k & 7)) & 1


_read_ties = _read_ties_py


def _write_ties_py(lo: Uint16Array, ties: Uint8Array, first: int, flags: Uint8Array) -> None:
    """Tie bit ``first + j`` = ``flags[j]`` for the block's midpoint elements (``lo[j] == 0x8000``); every
    other bit is left as it is. A scan of its own after the block's loop: counting midpoints inside that
    loop would put a 64-bit lane in it and halve its vector width."""
    mids = 0
    for j in range(lo.shape[0]):
        mids += lo[j] == 0x8000
    if mids:
        for j in range(lo.shape[0]):
            if lo[j] == 0x8000:
                k = first + j
                mask = np.uint8(1 << (k & 7))
                ties[k >> 3] = (ties[k >> 3] | mask) if flags[j] else (ties[k >> 3] & ~mask)


_write_ties = _write_ties_py


def _adam_py(
    gi: np.float32,
    mi: np.float32,
    vi: np.float32,
    coeff: np.float32,
    large: bool,
    beta2: np.float32,
    one_minus_beta2: np.float32,
    bc2_sqrt: np.float32,
    eps: np.float32,
    neg_step: np.float32,
) -> tuple[np.float32, np.float32, np.float32]:
    """One element's AdamW moments and parameter step (the part after weight decay), in fp32."""
    base = gi if large else mi
    mi = _fma32(coeff, gi - mi, base)
    vi = _fma32(one_minus_beta2 * gi, gi, vi * beta2)
    denom = np.sqrt(vi) / bc2_sqrt + eps
    return mi, vi, (neg_step * mi) / denom


_adam = _adam_py


def _update_block_py(
    p: Fp32Array,
    g: GradArray,
    m: Fp32Array,
    v: Fp32Array,
    scale: np.float32,
    decay: np.float32,
    coeff: np.float32,
    large: bool,
    beta2: np.float32,
    one_minus_beta2: np.float32,
    bc2_sqrt: np.float32,
    eps: np.float32,
    neg_step: np.float32,
) -> None:
    """Update one block in place: same-length slices, ``g`` fp32 or bf16-as-uint16, all math in fp32.

    The gradient applied is ``g * scale`` (fp32, one rounding; exact when ``scale`` is 1), the product
    ``_correct_block_py`` forms as ``gi * applied``. The loop runs over slices from index 0 so LLVM can prove
    the indices non-negative, drop numba's negative-index wraparound and vectorise (with ``start + j``
    indexing it stays scalar).
    """
    for j in range(p.shape[0]):
        gi = _as_fp32(g[j]) * scale
        mi, vi, step = _adam(gi, m[j], v[j], coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step)
        p[j] = p[j] * decay + step
        m[j] = mi
        v[j] = vi


_update_block = _update_block_py


def _update_block_split_py(
    hi: Uint16Array,
    lo: Uint16Array,
    ties: Uint8Array,
    first: int,
    flags: Uint8Array,
    g: GradArray,
    m: Fp32Array,
    v: Fp32Array,
    scale: np.float32,
    decay: np.float32,
    coeff: np.float32,
    large: bool,
    beta2: np.float32,
    one_minus_beta2: np.float32,
    bc2_sqrt: np.float32,
    eps: np.float32,
    neg_step: np.float32,
) -> None:
    """``_update_block_py`` over a split master block (``hi``/``lo`` uint16 words, tie bit ``first + j``,
    ``flags`` one scratch byte per element): the same fp32 arithmetic between ``_load_master`` and
    ``_store_master``."""
    _read_ties(lo, ties, first, flags)
    for j in range(hi.shape[0]):
        pj = _load_master(hi[j], lo[j], flags[j])
        gi = _as_fp32(g[j]) * scale
        mi, vi, step = _adam(gi, m[j], v[j], coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step)
        h, low, flags[j] = _store_master(pj * decay + step)
        hi[j] = h
        lo[j] = low
        m[j] = mi
        v[j] = vi
    _write_ties(lo, ties, first, flags)


_update_block_split = _update_block_split_py


def _adamw_split_py(
    hi: Uint16Array,
    lo: Uint16Array,
    ties: Uint8Array,
    first: int,
    flags: Uint8Array,
    g: GradArray,
    m: Fp32Array,
    v: Fp32Array,
    scale: np.float32,
    decay: np.float32,
    coeff: np.float32,
    large: bool,
    beta2: np.float32,
    one_minus_beta2: np.float32,
    bc2_sqrt: np.float32,
    eps: np.float32,
    neg_step: np.float32,
) -> None:
    """The whole split range, in blocks aligned to ``BLOCK`` in the tie numbering (so that no two threads
    write one tie byte): the first and last block may be shorter. ``flags``: one scratch byte per element."""
    n = hi.shape[0]
    skip = first % BLOCK
    for b in _prange((skip + n + BLOCK - 1) // BLOCK):
        s = max(b * BLOCK - skip, 0)
        e = min((b + 1) * BLOCK - skip, n)
        _update_block_split(
            hi[s:e], lo[s:e], ties, first + s, flags[s:e], g[s:e], m[s:e], v[s:e], scale, decay, coeff, large,
            beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
        )  # fmt: skip


def _adamw_py(
    p: Fp32Array,
    g: GradArray,
    m: Fp32Array,
    v: Fp32Array,
    scale: np.float32,
    decay: np.float32,
    coeff: np.float32,
    large: bool,
    beta2: np.float32,
    one_minus_beta2: np.float32,
    bc2_sqrt: np.float32,
    eps: np.float32,
    neg_step: np.float32,
) -> None:
    """The whole range, block by block across numba's threads."""
    n = p.shape[0]
    for b in _prange((n + BLOCK - 1) // BLOCK):
        s = b * BLOCK
        e = min(s + BLOCK, n)
        _update_block(
            p[s:e], g[s:e], m[s:e], v[s:e], scale, decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step
        )


def _correct_element_py(
    pi: np.float32,
    gi: np.float32,
    mi: np.float32,
    vi: np.float32,
    applied: np.float32,
    redo: bool,
    new_coeff: np.float32,
    first: bool,
    undo_decay: np.float32,
    coeff: np.float32,
    large: bool,
    beta1: np.float32,
    one_minus_beta1: np.float32,
    beta2: np.float32,
    one_minus_beta2: np.float32,
    bc2_sqrt: np.float32,
    eps: np.float32,
    neg_step: np.float32,
) -> tuple[np.float32, np.float32, np.float32]:
    """Take back one element's AdamW update that applied ``applied * g`` and, with ``redo``, apply it
    again with ``new_coeff * g``: clipping's correction (slide_core/optim/adamw_correction.py), fp32 math
    mirroring ``AdamWCorrection``'s torch ops (the moments' reversal is exact up to rounding)."""
    gs = gi * applied
    pi = pi + (-neg_step * mi) / (np.sqrt(vi) / bc2_sqrt + eps)
    if first:
        mi = np.float32(0.0)
        vi = np.float32(0.0)
    else:
        mi = (mi - one_minus_beta1 * gs) / beta1  # division, as torch's div_: not * (1 / beta1)
        vi = max(_fma32(-one_minus_beta2 * gs, gs, vi) / beta2, np.float32(0.0))
    if redo:
        mi, vi, step = _adam(gi * new_coeff, mi, vi, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step)
        pi = pi + step
    else:
        pi = pi / undo_decay
    return pi, mi, vi


_correct_element = _correct_element_py


def _correct_block_py(
    p: Fp32Array,
    g: GradArray,
    m: Fp32Array,
    v: Fp32Array,
    applied: np.float32,
    redo: bool,
    new_coeff: np.float32,
    first: bool,
    undo_decay: np.float32,
    coeff: np.float32,
    large: bool,
    beta1: np.float32,
    one_minus_beta1: np.float32,
    beta2: np.float32,
    one_minus_beta2: np.float32,
    bc2_sqrt: np.float32,
    eps: np.float32,
    neg_step: np.float32,
) -> None:
    """Clipping's correction of one block in one pass (``_correct_element_py``)."""
    for j in range(p.shape[0]):
        p[j], m[j], v[j] = _correct_element(
            p[j], _as_fp32(g[j]), m[j], v[j], applied, redo, new_coeff, first, undo_decay, coeff, large, beta1,
            one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
        )  # fmt: skip


_correct_block = _correct_block_py


def _correct_block_split_py(
    hi: Uint16Array,
    lo: Uint16Array,
    ties: Uint8Array,
    tie0: int,
    flags: Uint8Array,
    g: GradArray,
    m: Fp32Array,
    v: Fp32Array,
    applied: np.float32,
    redo: bool,
    new_coeff: np.float32,
    first: bool,
    undo_decay: np.float32,
    coeff: np.float32,
    large: bool,
    beta1: np.float32,
    one_minus_beta1: np.float32,
    beta2: np.float32,
    one_minus_beta2: np.float32,
    bc2_sqrt: np.float32,
    eps: np.float32,
    neg_step: np.float32,
) -> None:
    """``_correct_block_py`` over a split master block (tie bit ``tie0 + j``, ``flags`` scratch)."""
    _read_ties(lo, ties, tie0, flags)
    for j in range(hi.shape[0]):
        pi, m[j], v[j] = _correct_element(
            _load_master(hi[j], lo[j], flags[j]), _as_fp32(g[j]), m[j], v[j], applied, redo, new_coeff, first,
            undo_decay, coeff, large, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
        )  # fmt: skip
        h, low, flags[j] = _store_master(pi)
        hi[j] = h
        lo[j] = low
    _write_ties(lo, ties, tie0, flags)


_correct_block_split = _correct_block_split_py


def _correct_py(
    p: Fp32Array,
    g: GradArray,
    m: Fp32Array,
    v: Fp32Array,
    applied: np.float32,
    redo: bool,
    new_coeff: np.float32,
    first: bool,
    undo_decay: np.float32,
    coeff: np.float32,
    large: bool,
    beta1: np.float32,
    one_minus_beta1: np.float32,
    beta2: np.float32,
    one_minus_beta2: np.float32,
    bc2_sqrt: np.float32,
    eps: np.float32,
    neg_step: np.float32,
) -> None:
    """The whole range, block by block across numba's threads."""
    n = p.shape[0]
    for b in _prange((n + BLOCK - 1) // BLOCK):
        s = b * BLOCK
        e = min(s + BLOCK, n)
        _correct_block(
            p[s:e], g[s:e], m[s:e], v[s:e], applied, redo, new_coeff, first, undo_decay, coeff, large, beta1,
            one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
        )  # fmt: skip


def _correct_split_py(
    hi: Uint16Array,
    lo: Uint16Array,
    ties: Uint8Array,
    tie0: int,
    flags: Uint8Array,
    g: GradArray,
    m: Fp32Array,
    v: Fp32Array,
    applied: np.float32,
    redo: bool,
    new_coeff: np.float32,
    first: bool,
    undo_decay: np.float32,
    coeff: np.float32,
    large: bool,
    beta1: np.float32,
    one_minus_beta1: np.float32,
    beta2: np.float32,
    one_minus_beta2: np.float32,
    bc2_sqrt: np.float32,
    eps: np.float32,
    neg_step: np.float32,
) -> None:
    """The whole split range, in blocks aligned as ``_adamw_split_py``'s."""
    n = hi.shape[0]
    skip = tie0 % BLOCK
    for b in _prange((skip + n + BLOCK - 1) // BLOCK):
        s = max(b * BLOCK - skip, 0)
        e = min((b + 1) * BLOCK - skip, n)
        _correct_block_split(
            hi[s:e], lo[s:e], ties, tie0 + s, flags[s:e], g[s:e], m[s:e], v[s:e], applied, redo, new_coeff, first,
            undo_decay, coeff, large, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
        )  # fmt: skip


@functools.cache
def _kernels() -> Kernels:
    """Import numba and build the kernel (compiled, or loaded from numba's disk cache, per grad dtype on
    first call).

    ``cache=True`` stores the machine code in ``__pycache__`` next to this file (numba falls back to a
    per-user cache directory when that is read-only), so only the first process on a machine pays the
    few seconds of LLVM compile.
    """
    global _adam, _as_fp32, _fma32, _prange, _update_block, _correct_block, _correct_element
    global _decode, _encode, _load_master, _store_master, _read_ties, _write_ties
    global _update_block_split, _correct_block_split
    import numba
    from llvmlite import ir as llvm_ir  # type: ignore[import-untyped]  # llvmlite ships no type information
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def fma32(typingctx: BaseContext, a: types.Type, b: types.Type, c: types.Type) -> Typing:
        """A true fused multiply-add (``llvm.fma``), the single rounding torch's CPU kernels do."""
        sig = a(a, b, c)

        def codegen(
            context: Any, builder: llvm_ir.IRBuilder, signature: Signature, args: Sequence[llvm_ir.Value]
        ) -> llvm_ir.Value:
            t = args[0].type
            fn = builder.module.declare_intrinsic("llvm.fma", [t], llvm_ir.FunctionType(t, [t, t, t]))
            return builder.call(fn, args)

        return sig, codegen

    @intrinsic
    def as_fp32(typingctx: BaseContext, x: types.Type) -> Typing:
        """uint16 (bf16 bits) -> zext, shl 16, bitcast to fp32 in registers; fp32 -> itself.

        numba has no scalar bitcast; doing it in LLVM IR keeps the bf16 path one vectorised loop with no
        staging buffer (the block-buffer alternative measured ~20% slower)."""
        if x == types.uint16:

            def codegen(
                context: Any, builder: llvm_ir.IRBuilder, signature: Signature, args: Sequence[llvm_ir.Value]
            ) -> llvm_ir.Value:
                bits = builder.shl(
                    builder.zext(args[0], llvm_ir.IntType(32)), llvm_ir.Constant(llvm_ir.IntType(32), 16)
                )
                return builder.bitcast(bits, llvm_ir.FloatType())

            return types.float32(x), codegen
        if x == types.float32:
            return types.float32(x), lambda context, builder, signature, args: args[0]
        return None

    i8, i16, i32 = llvm_ir.IntType(8), llvm_ir.IntType(16), llvm_ir.IntType(32)

    def const(t: llvm_ir.IntType, value: int) -> llvm_ir.Constant:
        return llvm_ir.Constant(t, value)

    @intrinsic
    def decode(typingctx: BaseContext, h: types.Type, lo: types.Type, tie: types.Type) -> Typing:
        """Split master element -> fp32 in 32-bit integer ops (numba's own integer arithmetic widens to
        64 bits, which halves the vector lanes of the loop around it)."""
        if (h, lo, tie) != (types.uint16, types.uint16, types.uint8):
            return None

        def codegen(
            context: Any, builder: llvm_ir.IRBuilder, signature: Signature, args: Sequence[llvm_ir.Value]
        ) -> llvm_ir.Value:
            h32, lo32 = builder.zext(args[0], i32), builder.zext(args[1], i32)
            tie1 = builder.icmp_unsigned("!=", builder.and_(args[2], const(i8, 1)), const(i8, 0))
            above = builder.icmp_unsigned(">", lo32, const(i32, 0x8000))
            at = builder.icmp_unsigned("==", lo32, const(i32, 0x8000))
            up = builder.zext(builder.or_(above, builder.and_(at, tie1)), i32)
            upper = builder.sub(h32, up)
            bits = builder.or_(builder.shl(upper, const(i32, 16)), lo32)
            return builder.bitcast(bits, llvm_ir.FloatType())

        return types.float32(h, lo, tie), codegen

    @intrinsic
    def encode(typingctx: BaseContext, x: types.Type) -> Typing:
        """fp32 -> the split master's (hi, lo, tie), in 32-bit integer ops."""
        if x != types.float32:
            return None
        # numba's types.Tuple is unannotated (a class whose __new__ picks the tuple kind).
        tuple_type = cast("Callable[[tuple[types.Type, ...]], types.Type]", types.Tuple)
        result = tuple_type((types.uint16, types.uint16, types.uint8))

        def codegen(
            context: Any, builder: llvm_ir.IRBuilder, signature: Signature, args: Sequence[llvm_ir.Value]
        ) -> llvm_ir.Value:
            bits = builder.bitcast(args[0], i32)
            upper = builder.lshr(bits, const(i32, 16))
            rounded = builder.add(builder.add(bits, const(i32, 0x7FFF)), builder.and_(upper, const(i32, 1)))
            is_nan = builder.fcmp_unordered("uno", args[0], args[0])
            h = builder.select(is_nan, const(i32, 0x7FC0), builder.lshr(rounded, const(i32, 16)))
            tie = builder.zext(builder.icmp_unsigned("!=", h, upper), i8)
            parts = [builder.trunc(h, i16), builder.trunc(bits, i16), tie]
            return context.make_tuple(builder, signature.return_type, parts)

        return result(x), codegen

    _fma32, _as_fp32, _prange = _as_stand_in(fma32, _fma32_py), _as_stand_in(as_fp32, _as_fp32_py), numba.prange
    _decode, _encode = _as_stand_in(decode, _decode_py), _as_stand_in(encode, _encode_py)
    inline = numba.njit(inline="always", fastmath=False, nogil=True)
    _adam = inline(_adam_py)
    _update_block = inline(_update_block_py)
    _correct_element = inline(_correct_element_py)
    _correct_block = inline(_correct_block_py)
    _load_master, _store_master = inline(_load_master_py), inline(_store_master_py)
    _read_ties, _write_ties = inline(_read_ties_py), inline(_write_ties_py)
    _update_block_split = inline(_update_block_split_py)
    _correct_block_split = inline(_correct_block_split_py)
    kernel = numba.njit(parallel=True, fastmath=False, nogil=True, cache=True)

    step: dict[MasterFormat, RangeKernel] = {"fp32": kernel(_adamw_py), "split": kernel(_adamw_split_py)}
    correction: dict[MasterFormat, RangeKernel] = {"fp32": kernel(_correct_py), "split": kernel(_correct_split_py)}
    return Kernels(
        step=MappingProxyType(step),
        correction=MappingProxyType(correction),
        set_num_threads=numba.set_num_threads,
        get_num_threads=numba.get_num_threads,
        # numba.config sets its NUMBA_* names from the environment at import (through globals()), which
        # its type information cannot declare.
        max_threads=vars(numba.config)["NUMBA_NUM_THREADS"],
    )


def kernels() -> Kernels:
    """The compiled kernels (compiled, or loaded from numba's cache, on first call; thread-safe)."""
    with _compile_lock:
        return _kernels()


def step_scalars(config: AdamWConfig, lr: float, step: int, decay: bool) -> tuple[Any, ...]:
    """The update kernels' scalars after ``scale``, exactly as torch.optim.AdamW forms them: Python
    float64, then rounded to fp32 where the op rounds them (decay factor, lerp's coefficient and which
    end it starts from, beta2, 1 - beta2, sqrt of the second bias correction, eps, minus the step size)."""
    f32 = np.float32
    weight_decay = config.weight_decay if decay else 0.0
    decay_factor = f32(1 - lr * weight_decay) if weight_decay != 0 else f32(1.0)
    weight = f32(1 - config.beta1)  # lerp's weight, as an fp32 opmath scalar
    large = not abs(weight) < f32(0.5)
    coeff = weight - f32(1.0) if large else weight  # torch's vectorised lerp: fmadd(coeff, end - self, base)
    bias_correction1 = 1 - config.beta1**step
    bias_correction2_sqrt = (1 - config.beta2**step) ** 0.5
    return (
        decay_factor,
        f32(coeff),
        large,
        f32(config.beta2),
        f32(1 - config.beta2),
        f32(bias_correction2_sqrt),
        f32(config.eps),
        f32(-(lr / bias_correction1)),
    )


def grad_array(grad: torch.Tensor) -> np.ndarray:
    """A bf16 or fp32 host gradient as the kernels read it (bf16 as raw 16-bit words, widened in registers)."""
    if grad.dtype == torch.bfloat16:
        return kernel_array(grad.view(torch.int16), "grad").view(np.uint16)
    return kernel_array(grad, "grad")


_NO_FLAGS = np.empty(0, dtype=np.uint8)
"""The tie-flag scratch of a range that needs none (an fp32 master): zero bytes, never written."""


def fused_correct(
    config: AdamWConfig,
    master: torch.Tensor | MasterRange,
    grad: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    *,
    applied: float,
    new_coeff: float | None,
    lr: float,
    step: int,
    decay: bool,
) -> bool:
    """Clipping's correction of one host range in one pass (see ``_correct_block_py``); ``new_coeff``
    None takes the update back. Returns False (nothing done) when numba is not available, so the caller
    falls back to the torch ops."""
    master = as_master_range(master)
    if not numba_available() or master.device.type != "cpu":
        return False
    if grad.dtype not in (torch.bfloat16, torch.float32):
        return False
    compiled = _kernels()
    g = grad_array(grad)
    f32 = np.float32
    weight_decay = config.weight_decay if decay else 0.0
    w = 1.0 - config.beta1
    large = w >= 0.5
    flags_numel = master.kernel_flags_numel()
    flags = np.empty(flags_numel, dtype=np.uint8) if flags_numel else _NO_FLAGS
    compiled.correction[master.format](
        *master.kernel_operands(flags), g, kernel_array(state["exp_avg"], "exp_avg"),
        kernel_array(state["exp_avg_sq"], "exp_avg_sq"),
        f32(applied), new_coeff is not None, f32(new_coeff if new_coeff is not None else 1.0), step == 1,
        f32(1.0 - lr * weight_decay), f32(w - 1.0 if large else w), large, f32(config.beta1), f32(w),
        f32(config.beta2), f32(1.0 - config.beta2), f32(math.sqrt(1.0 - config.beta2**step)), f32(config.eps),
        f32(-lr / (1.0 - config.beta1**step)),
    )  # fmt: skip
    return True
