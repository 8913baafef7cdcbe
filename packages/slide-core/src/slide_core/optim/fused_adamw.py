"""AdamW in one fused, multi-threaded pass over a flat host range, compiled with numba.

Why: on the host the optimizer step is memory-bound, and it is the engine's bottleneck. Per parameter,
``TorchAdamW`` first casts the bf16 gradient into an fp32 scratch (read 2 bytes, write 4, plus 4 of
write-allocate) and then runs ``torch._fused_adamw_`` (read the fp32 gradient 4, read+write master 8,
exp_avg 8, exp_avg_sq 8): ~38-40 bytes per parameter through DRAM. This kernel reads the bf16 gradient
directly and widens it in registers (zero-extend, shift, bitcast), so a step moves 26 bytes per parameter (grad 2 + master 8 + exp_avg 8
+ exp_avg_sq 8): at the same bandwidth that is ~1.5x the parameters per second. Clipping's speculative
updates pass ``grad_scale`` (docs/design/engine.md, "Clipping"), and the kernel multiplies there too, so a
clipped step still moves 26 bytes per parameter instead of first writing ``c * g`` to an fp32 scratch
(~42 B/param).

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

numba is optional: nothing here imports it until a kernel is first needed (``step`` or ``warmup``), and
``import slide_core`` never does. ``best_adamw`` picks this optimizer when numba is importable and
falls back to ``TorchAdamW`` otherwise.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from slide_core.optim.adamw import TorchAdamW
from slide_core.optim.adamw_correction import AdamWCorrection
from slide_core.optimizer import AdamWConfig, Coefficient, Correction, Optimizer
from slide_core.split_master import TIE_BLOCK, SplitMaster

__all__ = ["FusedAdamW", "best_adamw"]

log = logging.getLogger(__name__)

BLOCK = TIE_BLOCK
"""Elements per parallel work item: ~4k items per 16M range, plenty to balance 16 threads, and each
item's five streams stay short enough for the hardware prefetchers to follow."""

_compile_lock = threading.Lock()


@functools.cache
def _numba_available() -> bool:
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


def _fma32(a, b, c):  # pragma: no cover - replaced by an llvm.fma intrinsic
    """fp32 ``a*b + c`` with one rounding."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _as_fp32(x):  # pragma: no cover - replaced by an intrinsic
    """A gradient element as fp32: a bf16's raw uint16 bits are the top half of the fp32's (exact)."""
    if isinstance(x, np.uint16):
        return np.array(np.uint32(x) << np.uint32(16)).view(np.float32)[()]
    return np.float32(x)


_prange = range


# The split master (slide_core/split_master.py): ``hi`` and ``lo`` as uint16 words, the tie bitmask as
# bytes. These two helpers are the whole per-element format; a kernel over a split master calls them
# where an fp32 kernel reads ``p[j]`` and writes it back, and ``_read_ties`` / ``_write_ties`` around
# its block loop move the rare tie bits between the bitmask and one byte per element.


def _decode_py(h, lo, tie):  # pragma: no cover - replaced by an intrinsic (i32 ops, one vector lane each)
    """The fp32 whose upper 16 bits are ``h`` minus the rounding that went up (``lo > 0x8000``, or ``lo
    == 0x8000`` and ``tie``) and whose low 16 bits are ``lo``."""
    up = int(lo) > 0x8000 or (int(lo) == 0x8000 and int(tie) & 1 == 1)
    bits = (((int(h) - up) & 0xFFFF) << 16) | int(lo)
    return np.array(np.uint32(bits)).view(np.float32)[()]


def _encode_py(x):  # pragma: no cover - replaced by an intrinsic (i32 ops, one vector lane each)
    """(hi, lo, tie) of one fp32: hi its bf16 round-to-nearest-even (torch's cast; a NaN becomes the
    quiet NaN 0x7FC0), lo its low 16 bits, tie 1 iff the rounding went up."""
    bits = int(np.array(np.float32(x)).view(np.uint32)[()])
    upper = bits >> 16
    h = 0x7FC0 if x != x else ((bits + 0x7FFF + (upper & 1)) >> 16) & 0xFFFF
    return np.uint16(h), np.uint16(bits & 0xFFFF), np.uint8(h != upper)


_decode = _decode_py
_encode = _encode_py


def _load_master_py(h, lo, tie):
    """One element of a split master as fp32 (``tie`` is looked at only when ``lo`` is 0x8000)."""
    return _decode(h, lo, tie)


_load_master = _load_master_py


def _store_master_py(x):
    """One fp32 value as the split master's (hi, lo, tie) of it (``tie`` matters only when lo is 0x8000)."""
    return _encode(x)


_store_master = _store_master_py


def _read_ties_py(lo, ties, first, flags):
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


def _write_ties_py(lo, ties, first, flags):
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


def _adam_py(gi, mi, vi, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step):
    """One element's AdamW moments and parameter step (the part after weight decay), in fp32."""
    base = gi if large else mi
    mi = _fma32(coeff, gi - mi, base)
    vi = _fma32(one_minus_beta2 * gi, gi, vi * beta2)
    denom = np.sqrt(vi) / bc2_sqrt + eps
    return mi, vi, (neg_step * mi) / denom


_adam = _adam_py


def _update_block_py(p, g, m, v, scale, decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step):
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
    hi, lo, ties, first, flags, g, m, v, scale, decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step
):
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
    hi, lo, ties, first, flags, g, m, v, scale, decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step
):
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


def _adamw_py(p, g, m, v, scale, decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step):
    """The whole range, block by block across numba's threads."""
    n = p.shape[0]
    for b in _prange((n + BLOCK - 1) // BLOCK):
        s = b * BLOCK
        e = min(s + BLOCK, n)
        _update_block(
            p[s:e], g[s:e], m[s:e], v[s:e], scale, decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step
        )


def _correct_element_py(
    pi, gi, mi, vi, applied, redo, new_coeff, first, undo_decay, coeff, large, beta1, one_minus_beta1, beta2,
    one_minus_beta2, bc2_sqrt, eps, neg_step,
):  # fmt: skip
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
    p,
    g,
    m,
    v,
    applied,
    redo,
    new_coeff,
    first,
    undo_decay,
    coeff,
    large,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    bc2_sqrt,
    eps,
    neg_step,
):
    """Clipping's correction of one block in one pass (``_correct_element_py``)."""
    for j in range(p.shape[0]):
        p[j], m[j], v[j] = _correct_element(
            p[j], _as_fp32(g[j]), m[j], v[j], applied, redo, new_coeff, first, undo_decay, coeff, large, beta1,
            one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
        )  # fmt: skip


_correct_block = _correct_block_py


def _correct_block_split_py(
    hi, lo, ties, tie0, flags, g, m, v, applied, redo, new_coeff, first, undo_decay, coeff, large, beta1,
    one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
):  # fmt: skip
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
    p,
    g,
    m,
    v,
    applied,
    redo,
    new_coeff,
    first,
    undo_decay,
    coeff,
    large,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    bc2_sqrt,
    eps,
    neg_step,
):
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
    hi, lo, ties, tie0, flags, g, m, v, applied, redo, new_coeff, first, undo_decay, coeff, large, beta1,
    one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
):  # fmt: skip
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
def _kernels() -> Any:
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
    from llvmlite import ir as llvm_ir
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def fma32(typingctx, a, b, c):
        """A true fused multiply-add (``llvm.fma``), the single rounding torch's CPU kernels do."""
        sig = a(a, b, c)

        def codegen(context, builder, signature, args):
            t = args[0].type
            fn = builder.module.declare_intrinsic("llvm.fma", [t], llvm_ir.FunctionType(t, [t, t, t]))
            return builder.call(fn, args)

        return sig, codegen

    @intrinsic
    def as_fp32(typingctx, x):
        """uint16 (bf16 bits) -> zext, shl 16, bitcast to fp32 in registers; fp32 -> itself.

        numba has no scalar bitcast; doing it in LLVM IR keeps the bf16 path one vectorised loop with no
        staging buffer (the block-buffer alternative measured ~20% slower)."""
        if x == types.uint16:

            def codegen(context, builder, signature, args):
                bits = builder.shl(
                    builder.zext(args[0], llvm_ir.IntType(32)), llvm_ir.Constant(llvm_ir.IntType(32), 16)
                )
                return builder.bitcast(bits, llvm_ir.FloatType())

            return types.float32(x), codegen
        if x == types.float32:
            return types.float32(x), lambda context, builder, signature, args: args[0]
        return None

    i8, i16, i32 = llvm_ir.IntType(8), llvm_ir.IntType(16), llvm_ir.IntType(32)

    def const(t, value):
        return llvm_ir.Constant(t, value)

    @intrinsic
    def decode(typingctx, h, lo, tie):
        """Split master element -> fp32 in 32-bit integer ops (numba's own integer arithmetic widens to
        64 bits, which halves the vector lanes of the loop around it)."""
        if (h, lo, tie) != (types.uint16, types.uint16, types.uint8):
            return None

        def codegen(context, builder, signature, args):
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
    def encode(typingctx, x):
        """fp32 -> the split master's (hi, lo, tie), in 32-bit integer ops."""
        if x != types.float32:
            return None
        result = types.Tuple((types.uint16, types.uint16, types.uint8))

        def codegen(context, builder, signature, args):
            bits = builder.bitcast(args[0], i32)
            upper = builder.lshr(bits, const(i32, 16))
            rounded = builder.add(builder.add(bits, const(i32, 0x7FFF)), builder.and_(upper, const(i32, 1)))
            is_nan = builder.fcmp_unordered("uno", args[0], args[0])
            h = builder.select(is_nan, const(i32, 0x7FC0), builder.lshr(rounded, const(i32, 16)))
            tie = builder.zext(builder.icmp_unsigned("!=", h, upper), i8)
            parts = [builder.trunc(h, i16), builder.trunc(bits, i16), tie]
            return context.make_tuple(builder, signature.return_type, parts)

        return result(x), codegen

    _fma32, _as_fp32, _prange = fma32, as_fp32, numba.prange
    _decode, _encode = decode, encode
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

    class Kernels:
        adamw = kernel(_adamw_py)
        correct = kernel(_correct_py)
        adamw_split = kernel(_adamw_split_py)
        correct_split = kernel(_correct_split_py)
        set_num_threads = staticmethod(numba.set_num_threads)
        get_num_threads = staticmethod(numba.get_num_threads)
        max_threads = numba.config.NUMBA_NUM_THREADS

    return Kernels


def _np(t: torch.Tensor, name: str) -> np.ndarray:
    if t.device.type != "cpu":
        raise ValueError(f"FusedAdamW runs on host tensors, got {name} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"FusedAdamW needs contiguous ranges, {name} is not")
    return t.detach().numpy()


def _split_np(master: SplitMaster, flags: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray]:
    """A split range as the kernels take it: hi and lo as uint16 words, the tie bytes, the first tie bit,
    and ``flags`` (at least one scratch byte per element: each block's tie bits, unpacked)."""
    hi = _np(master.hi.view(torch.int16), "master hi").view(np.uint16)
    lo = _np(master.lo, "master lo").view(np.uint16)
    return hi, lo, _np(master.ties, "master ties"), master.offset, flags[: master.numel()]


class FusedAdamW(Optimizer):
    """AdamW (decoupled weight decay, applied only to ranges flagged ``decay``) as one numba kernel.

    ``grad`` may be bf16 (read as raw 16-bit words, never materialised in fp32), fp32, or any other float
    dtype (cast into a reserved fp32 scratch first, like ``TorchAdamW``). ``grad_scale`` is applied in
    registers, never through a scaled copy. ``threads`` caps numba's worker count for this optimizer's calls
    (default: all of numba's threads, i.e. every core).
    """

    state_names = ("exp_avg", "exp_avg_sq")
    split_master = True

    def __init__(self, config: AdamWConfig, *, threads: int | None = None) -> None:
        super().__init__(config)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._flags = np.empty(0, dtype=np.uint8)  # a split master's unpacked tie bits, one byte per element
        self._reserved = 0
        self._off_host: TorchAdamW | None = None
        self._correction = AdamWCorrection(config)

    def device_replica(self) -> TorchAdamW:
        """Device ranges go through torch's kernels (numba runs on the host only)."""
        return TorchAdamW(self.config)

    def _device_fallback(self) -> TorchAdamW:
        """Ranges that live on an accelerator go through torch's kernels (numba only runs on the host)."""
        if self._off_host is None:
            self._off_host = TorchAdamW(self.config)
        return self._off_host

    @staticmethod
    def available() -> bool:
        """Whether numba imports here (the kernels are compiled on first use, not by this check)."""
        return _numba_available()

    def host_scratch_bytes(self, max_range_numel: int, *, corrects: bool = False, split_master: bool = False) -> int:
        """A split master's unpacked tie bits (one byte per element of the reserved range) and, with
        ``corrects``, the torch-ops correction's pieces. bf16 and fp32 gradients need no fp32 scratch."""
        if max_range_numel <= 0:
            return 0
        held = max_range_numel if split_master else 0
        if corrects:
            held += self._correction.host_scratch_bytes(max_range_numel, split_master=split_master)
        return held

    def reserve(self, max_range_numel: int, device: torch.device | str = "cpu") -> None:
        """Remember the largest host range. The fp32 scratch is needed only for gradients that are neither
        bf16 nor fp32 (e.g. fp16), so it is allocated, at this size, the first time one arrives rather than
        here: bf16/fp32 training never holds the 4 B/elt the cast-first ``TorchAdamW`` needs."""
        device = torch.device(device)
        if device.type != "cpu":
            self._device_fallback().reserve(max_range_numel, device)
        else:
            self._reserved = max(self._reserved, max_range_numel)

    def _kernels(self) -> Any:
        if not _numba_available():
            raise RuntimeError("FusedAdamW needs numba (pip install numba); use TorchAdamW without it")
        with _compile_lock:
            kernels = _kernels()
        if self.threads is not None:
            # numba's thread count is a per-calling-thread setting, so it is checked on every call (~1 us).
            want = min(self.threads, kernels.max_threads)
            if kernels.get_num_threads() != want:
                kernels.set_num_threads(want)
        return kernels

    def warmup(self) -> None:
        """Compile (or load from cache) the bf16 and fp32 kernels on tiny arrays, off the critical path."""
        config = AdamWConfig(weight_decay=0.1)
        master = torch.ones(3)
        state = {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
        split = SplitMaster(
            torch.ones(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int16), torch.zeros(1, dtype=torch.uint8)
        )
        for target in (master, split):
            for dtype in (torch.bfloat16, torch.float32):
                FusedAdamW(config, threads=self.threads).step(
                    target, torch.ones(3, dtype=dtype), state, lr=1e-3, step=1, decay=True
                )

    def step(
        self,
        master: torch.Tensor | SplitMaster,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float = 1.0,
    ) -> None:
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        n = master.numel()
        if not (grad.numel() == exp_avg.numel() == exp_avg_sq.numel() == n):
            raise ValueError(
                f"range sizes differ: master {n}, grad {grad.numel()}, "
                f"exp_avg {exp_avg.numel()}, exp_avg_sq {exp_avg_sq.numel()}"
            )
        fp32 = (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))
        for name, t in fp32 if isinstance(master, SplitMaster) else (("master", master), *fp32):
            if t.dtype != torch.float32:
                raise ValueError(f"{name} must be fp32, got {t.dtype}")
        if n == 0:
            return
        if master.device.type != "cpu":
            self._device_fallback().step(master, grad, state, lr=lr, step=step, decay=decay, grad_scale=grad_scale)
            return
        kernels = self._kernels()
        cfg = self.config
        f32 = np.float32
        # Scalars exactly as torch.optim.AdamW forms them: Python float64, then rounded to fp32 by the op.
        weight_decay = cfg.weight_decay if decay else 0.0
        decay_factor = f32(1 - lr * weight_decay) if weight_decay != 0 else f32(1.0)
        weight = f32(1 - cfg.beta1)  # lerp's weight, as an fp32 opmath scalar
        large = not abs(weight) < f32(0.5)
        coeff = weight - f32(1.0) if large else weight  # torch's vectorised lerp: fmadd(coeff, end - self, base)
        bias_correction1 = 1 - cfg.beta1**step
        bias_correction2_sqrt = (1 - cfg.beta2**step) ** 0.5
        args = (
            decay_factor,
            f32(coeff),
            large,
            f32(cfg.beta2),
            f32(1 - cfg.beta2),
            f32(bias_correction2_sqrt),
            f32(cfg.eps),
            f32(-(lr / bias_correction1)),
        )
        m, v = _np(exp_avg, "exp_avg"), _np(exp_avg_sq, "exp_avg_sq")
        if grad.dtype == torch.bfloat16:
            g = _np(grad.view(torch.int16), "grad").view(np.uint16)  # raw bits; widened in registers
        else:
            if grad.dtype != torch.float32:
                if self._scratch.numel() < n:
                    self._scratch = torch.empty(max(n, self._reserved), dtype=torch.float32)
                grad = self._scratch[:n].copy_(grad)
            g = _np(grad, "grad")
        # One kernel for every scale: multiplying by 1.0f is exact, and the scale is always an fp32 scalar,
        # so the compiled (and cached) signatures are the same two as without clipping (bf16, fp32 grads).
        if isinstance(master, SplitMaster):
            if self._flags.shape[0] < n:
                self._flags = np.empty(max(n, self._reserved), dtype=np.uint8)
            kernels.adamw_split(*_split_np(master, self._flags), g, m, v, f32(grad_scale), *args)
        else:
            kernels.adamw(_np(master, "master"), g, m, v, f32(grad_scale), *args)

    def correct(
        self,
        master: torch.Tensor | SplitMaster,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        applied: Coefficient,
        correction: Correction,
        lr: float,
        step: int,
        decay: bool,
    ) -> None:
        """One pass over a host range (``fused_correct``), the torch ops elsewhere (AdamWCorrection)."""
        self._correction.apply(correction, master, grad, applied, state, lr=lr, step=step, decay=decay)


def best_adamw(config: AdamWConfig, *, threads: int | None = None, warmup: bool = True) -> Optimizer:
    """The fastest host AdamW this environment can run: ``FusedAdamW`` with numba, else ``TorchAdamW``.

    With ``warmup`` (the default) the kernels are compiled (or loaded from numba's cache) here, off the
    training critical path, and a compile failure falls back to ``TorchAdamW`` instead of failing the
    first step. ``threads`` applies to ``FusedAdamW`` only.
    """
    if not FusedAdamW.available():
        log.info("host optimizer: TorchAdamW (numba not importable; bf16 grads cast first, ~40 B/param)")
        return TorchAdamW(config)
    optimizer = FusedAdamW(config, threads=threads)
    if warmup:
        try:
            optimizer.warmup()
        except Exception:
            log.warning("host optimizer: FusedAdamW failed to compile, using TorchAdamW", exc_info=True)
            return TorchAdamW(config)
    log.info("host optimizer: FusedAdamW (numba, one fused pass, 26 B/param)")
    return optimizer


def fused_correct(
    config: AdamWConfig,
    master: torch.Tensor | SplitMaster,
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
    if not _numba_available() or master.device.type != "cpu":
        return False
    if grad.dtype not in (torch.bfloat16, torch.float32):
        return False
    kernels = _kernels()
    g = _np(grad.view(torch.uint16) if grad.dtype == torch.bfloat16 else grad, "grad")
    f32 = np.float32
    weight_decay = config.weight_decay if decay else 0.0
    w = 1.0 - config.beta1
    large = w >= 0.5
    if isinstance(master, SplitMaster):
        kernel, planes = kernels.correct_split, _split_np(master, np.empty(master.numel(), dtype=np.uint8))
    else:
        kernel, planes = kernels.correct, (_np(master, "master"),)
    kernel(
        *planes, g, _np(state["exp_avg"], "exp_avg"), _np(state["exp_avg_sq"], "exp_avg_sq"),
        f32(applied), new_coeff is not None, f32(new_coeff if new_coeff is not None else 1.0), step == 1,
        f32(1.0 - lr * weight_decay), f32(w - 1.0 if large else w), large, f32(config.beta1), f32(w),
        f32(config.beta2), f32(1.0 - config.beta2), f32(math.sqrt(1.0 - config.beta2**step)), f32(config.eps),
        f32(-lr / (1.0 - config.beta1**step)),
    )  # fmt: skip
    return True
