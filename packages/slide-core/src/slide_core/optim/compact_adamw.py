"""AdamW whose moments are stored compactly (bf16 or int8, slide_core/optim/state_formats.py).

Two paths give the same codes from the same fp32 moments:

- **fused** (host ranges, numba): one multi-threaded pass like ``FusedAdamW``'s. Each element's moments
  are widened in registers, updated by the fused kernel's own element function (``_adam`` of
  _adamw_kernels.py, so the fp32 arithmetic is the same op for op), the master stepped with the fp32 moments,
  and the moments written back with stochastic rounding. int8 works per 4096-element item in two passes
  over each 64-element block, both in cache: update (the fp32 moments go to a small scratch, the block
  maxima are formed), then encode against the new maxima. Bytes per parameter and step: bf16 grad 2 +
  master 8 + moments 2 x 4 (bf16) = 18, or 2 x 2 + 2 x 8/64 (int8) = ~14.25.
- **torch** (any device, and the host without numba): a chunk of at most ``chunk_numel`` elements at a
  time (``adamw.CHUNK_NUMEL``, a multiple of the int8 block), decode it into an fp32 scratch, run
  ``TorchAdamW``'s step on it (``torch._fused_adamw_`` where the build has it: on the host the same fp32
  arithmetic as the numba kernel, so a unit's master is the same bits whichever side updated it; the
  single-tensor ops order the update differently and would not be), encode it in place with the torch twins of the same hash and
  rounding, each element hashed at its own index (the range's first plus its position), so the codes are
  bit for bit the unchunked ones and the fused kernels'. It is what device-resident units use
  (``device_replica``): a resident embedding of 394M parameters is updated with a few chunks of scratch
  (``device_scratch_bytes``, which the planner adds to the GPU peak) instead of fp32 copies of itself.
  It is also the reference the kernels are tested against.

The hash's element index is the master range's offset in its storage (``MasterRange.index0``: an fp32
range's ``storage_offset()``, a split master's ``offset``): for the engine's host units that is the element's position in the master slab,
the same for a unit whose state is staged from NVMe, across a resume, and for either master format. Device-resident units have one master tensor each, so their indices
restart at 0 per unit (their streams are still distinct per step).

The moments' format is a codec (``state_formats.MomentCodec``) the optimizer is handed, or resolves from
``config.state_format`` once: every widening and rounding goes through it.

Clipping's correction (``correct``) decodes, corrects in fp32 (``AdamWOptimizer.correct``, the one every
AdamW shares) and encodes again with its own hash stream. Because the stored moments are rounded, taking an update back is exact only to the
format's rounding (bf16: ~2^-9 of the moments, int8: a step of its code), not to fp32's few ulp.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np
import torch
from numpy.typing import NDArray

from slide_core.master_store import MasterFormat, MasterRange, as_master_range
from slide_core.optim import _adamw_kernels, state_formats
from slide_core.optim._adamw_kernels import (
    Fp32Array,
    GradArray,
    RangeKernel,
    Uint8Array,
    Uint16Array,
    _as_stand_in,
)
from slide_core.optim._moment_intrinsics import (
    AbsBits,
    DecodeM8,
    DecodeV8,
    EncodeM8,
    EncodeV8,
    Hash32,
    High16,
    SrBf16,
    numba_twins,
)
from slide_core.optim.adamw import CHUNK_NUMEL, TorchAdamW
from slide_core.optim.adamw_base import AdamWOptimizer
from slide_core.optim.adamw_config import AdamWConfig
from slide_core.optim.adamw_correction import DEFAULT_PIECE_NUMEL
from slide_core.optim.fused_adamw import FusedAdamW
from slide_core.optim.state_formats import (
    CORRECTION_SALT,
    QUANT_BLOCK,
    STEP_SALT,
    Fp32Moments,
    MomentCodec,
    StateArray,
    moment_codec,
    slice_state,
    stream_key,
)
from slide_core.optimizer import Coefficient, Correction, scale_into
from slide_core.split_master import SplitMaster, kernel_array

if TYPE_CHECKING:
    from numba.core import types
    from numba.core.typing.context import BaseContext
    from numba.core.typing.templates import Signature

    from slide_core.optim._moment_intrinsics import Typing

__all__ = ["CompactAdamW", "compact_bytes_per_param"]

BLOCK = _adamw_kernels.BLOCK
"""Elements per parallel work item (64 int8 blocks), as in the fp32 kernel."""

_compile_lock = threading.Lock()

Int8Array: TypeAlias = NDArray[np.int8]
"""int8 exp_avg codes."""


@dataclasses.dataclass(frozen=True)
class CompactKernels:
    """What :func:`_kernels` returns: the compiled update by (``MomentCodec.name``, ``MasterRange.format``)."""

    step: Mapping[tuple[str, MasterFormat], RangeKernel]


def compact_bytes_per_param(state_format: str) -> float:
    """What the fused host step moves per parameter (bf16 gradient, fp32 master, the format's moments)."""
    return 2 + 8 + 2 * state_formats.state_bytes_per_param(state_format)


# Kernels as plain Python until ``_kernels`` compiles them (module level for numba's disk cache, as in
# _adamw_kernels.py). ``_adam``/``_as_fp32`` are _adamw_kernels' jitted element helpers, then the state_formats
# intrinsics (``NumbaTwins``: ``_hash32``, ``_sr_bf16``, ...), ``_prange`` numba's; all bound by ``_kernels`` before the first compile.
_adam = _adamw_kernels._adam_py
_as_fp32 = _adamw_kernels._as_fp32
_load_master = _adamw_kernels._load_master_py
_store_master = _adamw_kernels._store_master_py
_read_ties = _adamw_kernels._read_ties_py
_write_ties = _adamw_kernels._write_ties_py
_prange = range
# The intrinsics have no Python stand-ins (they exist as LLVM IR only): declared here, bound by ``_kernels``.
_hash32: Hash32
_high16: High16
_sr_bf16: SrBf16
_abs_bits: AbsBits
_encode_m8: EncodeM8
_encode_v8: EncodeV8
_decode_m8: DecodeM8
_decode_v8: DecodeV8


def _hash_run_py(first: np.int64, numel: int, k1: np.uint32) -> tuple[int, np.uint32, np.uint32]:
    """How many of ``numel`` elements from hash index ``first`` on keep its high 32 bits (all of them but
    once every 2^32 indices), and ``hash32``'s operands for them: the low half of ``first`` and the
    high half xor ``k1``, one constant per run (``NumbaTwins.hash32``)."""
    lo = int(first & 0xFFFFFFFF)
    return min(numel, (1 << 32) - lo), np.uint32(lo), np.uint32(np.uint32(first >> 32) ^ k1)


_hash_run = _hash_run_py


def _bf16_block_py(
    p: Fp32Array,
    g: GradArray,
    m: Uint16Array,
    v: Uint16Array,
    lo0: np.uint32,
    hi_key: np.uint32,
    k0: np.uint32,
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
    """One run of a work item (slices from index 0, so LLVM vectorises it; ``lo0``/``hi_key``: its first
    hash index as ``_hash_run`` gives it)."""
    for j in range(p.shape[0]):
        gi = _as_fp32(g[j]) * scale
        mi, vi, step = _adam(
            gi, _as_fp32(m[j]), _as_fp32(v[j]), coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step
        )
        p[j] = p[j] * decay + step
        bits = _hash32(lo0, j, hi_key, k0)
        m[j] = _sr_bf16(mi, bits)
        v[j] = _sr_bf16(vi, _high16(bits))


_bf16_block = _bf16_block_py


def _adamw_bf16_py(
    p: Fp32Array,
    g: GradArray,
    m: Uint16Array,
    v: Uint16Array,
    index0: np.int64,
    k0: np.uint32,
    k1: np.uint32,
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
    """bf16 moments (``m``, ``v``: uint16 bits): widen, update in fp32, round back stochastically. A work
    item is one run of ``_bf16_block`` unless its hash index carries into the high half inside it."""
    n = p.shape[0]
    for b in _prange((n + BLOCK - 1) // BLOCK):
        s = b * BLOCK
        e = min(s + BLOCK, n)
        while s < e:
            run, lo0, hi_key = _hash_run(index0 + s, e - s, k1)
            r = s + run
            _bf16_block(
                p[s:r], g[s:r], m[s:r], v[s:r], lo0, hi_key, k0, scale, decay, coeff, large, beta2,
                one_minus_beta2, bc2_sqrt, eps, neg_step,
            )  # fmt: skip
            s = r


def _int8_block_py(
    p: Fp32Array,
    g: GradArray,
    m: Int8Array,
    v: Uint8Array,
    mt: Fp32Array,
    vt: Fp32Array,
    k: int,
    m_scale: np.float32,
    v_scale: np.float32,
    scale: np.float32,
    decay: np.float32,
    coeff: np.float32,
    large: bool,
    beta2: np.float32,
    one_minus_beta2: np.float32,
    bc2_sqrt: np.float32,
    eps: np.float32,
    neg_step: np.float32,
) -> tuple[np.uint32, np.uint32]:
    """Pass 1 over the first ``k`` elements of one 64-element block: decode, fp32 AdamW, master step; the
    new moments go to ``mt``/``vt``. Returns the bits of their largest magnitudes (integer maxima of
    non-negative floats' bits). Callers pass ``k`` as the literal ``QUANT_BLOCK`` for a whole block: the
    trip count LLVM then knows drops the vector loop's remainder and its run-time checks."""
    m_max = np.uint32(0)
    v_max = np.uint32(0)
    for j in range(k):
        gi = _as_fp32(g[j]) * scale
        mi = _decode_m8(m[j], m_scale)
        vi = _decode_v8(v[j], v_scale)
        mi, vi, step = _adam(gi, mi, vi, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step)
        p[j] = p[j] * decay + step
        mt[j] = mi
        vt[j] = vi
        m_max = max(m_max, _abs_bits(mi))
        v_max = max(v_max, _abs_bits(vi))
    return m_max, v_max


_int8_block = _int8_block_py


def _int8_run_py(
    m: Int8Array,
    v: Uint8Array,
    mt: Fp32Array,
    vt: Fp32Array,
    start: int,
    stop: int,
    m_inv: np.float32,
    v_inv: np.float32,
    lo0: np.uint32,
    hi_key: np.uint32,
    k0: np.uint32,
) -> None:
    """Pass 2 over elements ``[start, stop)`` of a block, one hash run (``_hash_run``) from ``start``."""
    for j in range(start, stop):
        bits = _hash32(lo0, j - start, hi_key, k0)
        m[j] = _encode_m8(mt[j], m_inv, bits)
        v[j] = _encode_v8(vt[j], v_inv, _high16(bits))


_int8_run = _int8_run_py


def _int8_encode_py(
    m: Int8Array,
    v: Uint8Array,
    mt: Fp32Array,
    vt: Fp32Array,
    k: int,
    m_inv: np.float32,
    v_inv: np.float32,
    first: np.int64,
    k0: np.uint32,
    k1: np.uint32,
) -> None:
    """Pass 2: the block's ``k`` new moments as codes against its new scales (``first``: its hash index).
    A whole block that keeps its high half, nearly every one, is one run of a trip count LLVM knows."""
    j = 0
    while j < k:
        run, lo0, hi_key = _hash_run(first + j, k - j, k1)
        if run == QUANT_BLOCK:
            _int8_run(m, v, mt, vt, 0, QUANT_BLOCK, m_inv, v_inv, lo0, hi_key, k0)
        else:  # a range's tail, or the block where the index's low half wraps
            _int8_run(m, v, mt, vt, j, j + run, m_inv, v_inv, lo0, hi_key, k0)
        j += run


_int8_encode = _int8_encode_py


def _int8_scales_py(m_bits: np.uint32, v_bits: np.uint32) -> tuple[np.float32, np.float32, np.float32, np.float32]:
    """A block's new scales (its largest magnitudes, from pass 1's maxima of their bits) and the inverses
    pass 2 multiplies by (0 for an all-zero block)."""
    one = np.float32(1.0)
    zero = np.float32(0.0)
    m_max = _bits_f32(np.uint64(m_bits))
    v_max = _bits_f32(np.uint64(v_bits))
    return m_max, v_max, one / m_max if m_max > zero else zero, one / v_max if v_max > zero else zero


_int8_scales = _int8_scales_py


def _adamw_int8_py(
    p: Fp32Array,
    g: GradArray,
    m: Int8Array,
    v: Uint8Array,
    m_scale: Fp32Array,
    v_scale: Fp32Array,
    index0: np.int64,
    k0: np.uint32,
    k1: np.uint32,
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
    """int8 moments with one fp32 scale per 64-element block (``m`` int8, ``v`` uint8)."""
    n = p.shape[0]
    for b in _prange((n + BLOCK - 1) // BLOCK):
        s = b * BLOCK
        e = min(s + BLOCK, n)
        mt = np.empty(QUANT_BLOCK, dtype=np.float32)
        vt = np.empty(QUANT_BLOCK, dtype=np.float32)
        for q in range(s // QUANT_BLOCK, (e + QUANT_BLOCK - 1) // QUANT_BLOCK):
            qs = q * QUANT_BLOCK
            qe = min(qs + QUANT_BLOCK, e)
            k = qe - qs
            first = index0 + qs
            run, lo0, hi_key = _hash_run(first, k, k1)
            if run == QUANT_BLOCK:
                # A whole block whose hash indices keep their high half (all but a range's tail and one
                # block in 2^26): both passes with the trip count LLVM knows, in one branch (measured
                # ~10 % faster per element than testing the two passes' conditions apart).
                m_bits, v_bits = _int8_block(
                    p[qs:qe], g[qs:qe], m[qs:qe], v[qs:qe], mt, vt, QUANT_BLOCK, m_scale[q], v_scale[q], scale,
                    decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
                )  # fmt: skip
                m_max, v_max, m_inv, v_inv = _int8_scales(m_bits, v_bits)
                m_scale[q] = m_max
                v_scale[q] = v_max
                _int8_run(m[qs:qe], v[qs:qe], mt, vt, 0, QUANT_BLOCK, m_inv, v_inv, lo0, hi_key, k0)
                continue
            m_bits, v_bits = _int8_block(
                p[qs:qe], g[qs:qe], m[qs:qe], v[qs:qe], mt, vt, k, m_scale[q], v_scale[q], scale, decay, coeff,
                large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
            )  # fmt: skip
            m_max, v_max, m_inv, v_inv = _int8_scales(m_bits, v_bits)
            m_scale[q] = m_max
            v_scale[q] = v_max
            _int8_encode(m[qs:qe], v[qs:qe], mt, vt, k, m_inv, v_inv, first, k0, k1)


# Split master (slide_core/split_master.py): the same kernels with the master read and written through
# fused_adamw's ``_load_master`` / ``_store_master`` and its tie bits moved around each work item by
# ``_read_ties`` / ``_write_ties``; work items are aligned to ``BLOCK`` in the tie numbering as in
# ``_adamw_kernels._adamw_split_py`` (a range starts on a 64-element block, so int8 blocks stay whole).


def _bf16_split_block_py(
    hi: Uint16Array,
    lo: Uint16Array,
    flags: Uint8Array,
    g: GradArray,
    m: Uint16Array,
    v: Uint16Array,
    lo0: np.uint32,
    hi_key: np.uint32,
    k0: np.uint32,
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
    """``_bf16_block_py`` over a run of a split master block (its tie flags already read into ``flags``)."""
    for j in range(hi.shape[0]):
        pj = _load_master(hi[j], lo[j], flags[j])
        gi = _as_fp32(g[j]) * scale
        mi, vi, step = _adam(
            gi, _as_fp32(m[j]), _as_fp32(v[j]), coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step
        )
        h, low, flags[j] = _store_master(pj * decay + step)
        hi[j] = h
        lo[j] = low
        bits = _hash32(lo0, j, hi_key, k0)
        m[j] = _sr_bf16(mi, bits)
        v[j] = _sr_bf16(vi, _high16(bits))


_bf16_split_block = _bf16_split_block_py


def _adamw_bf16_split_py(
    hi: Uint16Array,
    lo: Uint16Array,
    ties: Uint8Array,
    first: int,
    flags: Uint8Array,
    g: GradArray,
    m: Uint16Array,
    v: Uint16Array,
    index0: np.int64,
    k0: np.uint32,
    k1: np.uint32,
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
    n = hi.shape[0]
    skip = first % BLOCK
    for b in _prange((skip + n + BLOCK - 1) // BLOCK):
        s = max(b * BLOCK - skip, 0)
        e = min((b + 1) * BLOCK - skip, n)
        _read_ties(lo[s:e], ties, first + s, flags[s:e])
        i = s
        while i < e:
            run, lo0, hi_key = _hash_run(index0 + i, e - i, k1)
            r = i + run
            _bf16_split_block(
                hi[i:r], lo[i:r], flags[i:r], g[i:r], m[i:r], v[i:r], lo0, hi_key, k0, scale, decay, coeff, large,
                beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
            )  # fmt: skip
            i = r
        _write_ties(lo[s:e], ties, first + s, flags[s:e])


def _int8_split_block_py(
    hi: Uint16Array,
    lo: Uint16Array,
    flags: Uint8Array,
    g: GradArray,
    m: Int8Array,
    v: Uint8Array,
    mt: Fp32Array,
    vt: Fp32Array,
    k: int,
    m_scale: np.float32,
    v_scale: np.float32,
    scale: np.float32,
    decay: np.float32,
    coeff: np.float32,
    large: bool,
    beta2: np.float32,
    one_minus_beta2: np.float32,
    bc2_sqrt: np.float32,
    eps: np.float32,
    neg_step: np.float32,
) -> tuple[np.uint32, np.uint32]:
    """``_int8_block_py`` over a split master block (its tie flags already read into ``flags``)."""
    m_max = np.uint32(0)
    v_max = np.uint32(0)
    for j in range(k):
        pj = _load_master(hi[j], lo[j], flags[j])
        gi = _as_fp32(g[j]) * scale
        mi = _decode_m8(m[j], m_scale)
        vi = _decode_v8(v[j], v_scale)
        mi, vi, step = _adam(gi, mi, vi, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step)
        h, low, flags[j] = _store_master(pj * decay + step)
        hi[j] = h
        lo[j] = low
        mt[j] = mi
        vt[j] = vi
        m_max = max(m_max, _abs_bits(mi))
        v_max = max(v_max, _abs_bits(vi))
    return m_max, v_max


_int8_split_block = _int8_split_block_py


def _adamw_int8_split_py(
    hi: Uint16Array,
    lo: Uint16Array,
    ties: Uint8Array,
    first: int,
    flags: Uint8Array,
    g: GradArray,
    m: Int8Array,
    v: Uint8Array,
    m_scale: Fp32Array,
    v_scale: Fp32Array,
    index0: np.int64,
    k0: np.uint32,
    k1: np.uint32,
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
    n = hi.shape[0]
    skip = first % BLOCK
    one = np.float32(1.0)
    zero = np.float32(0.0)
    for b in _prange((skip + n + BLOCK - 1) // BLOCK):
        s = max(b * BLOCK - skip, 0)
        e = min((b + 1) * BLOCK - skip, n)
        mt = np.empty(QUANT_BLOCK, dtype=np.float32)
        vt = np.empty(QUANT_BLOCK, dtype=np.float32)
        _read_ties(lo[s:e], ties, first + s, flags[s:e])
        for qs in range(s, e, QUANT_BLOCK):
            q = qs // QUANT_BLOCK
            qe = min(qs + QUANT_BLOCK, e)
            k = qe - qs
            if k == QUANT_BLOCK:
                m_bits, v_bits = _int8_split_block(
                    hi[qs:qe], lo[qs:qe], flags[qs:qe], g[qs:qe], m[qs:qe], v[qs:qe], mt, vt, QUANT_BLOCK,
                    m_scale[q], v_scale[q], scale, decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps,
                    neg_step,
                )  # fmt: skip
            else:
                m_bits, v_bits = _int8_split_block(
                    hi[qs:qe], lo[qs:qe], flags[qs:qe], g[qs:qe], m[qs:qe], v[qs:qe], mt, vt, k, m_scale[q],
                    v_scale[q], scale, decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step,
                )  # fmt: skip
            m_max = _bits_f32(np.uint64(m_bits))
            v_max = _bits_f32(np.uint64(v_bits))
            m_scale[q] = m_max
            v_scale[q] = v_max
            _int8_encode(
                m[qs:qe], v[qs:qe], mt, vt, k, one / m_max if m_max > zero else zero,
                one / v_max if v_max > zero else zero, index0 + qs, k0, k1,
            )  # fmt: skip
        _write_ties(lo[s:e], ties, first + s, flags[s:e])


def _bits_f32_py(u: np.uint64) -> np.float32:  # pragma: no cover - replaced by an intrinsic
    """The low 32 bits of a uint64 as fp32."""
    return np.float32(np.array(np.uint32(u)).view(np.float32)[()])


_bits_f32 = _bits_f32_py


@functools.cache
def _kernels() -> CompactKernels:
    """Compile (or load from numba's cache) the compact-state kernels; numba is imported only here."""
    global _adam, _as_fp32, _prange, _bits_f32, _bf16_block, _int8_block, _int8_encode, _int8_run, _hash_run
    global _int8_scales
    global _load_master, _store_master, _read_ties, _write_ties, _bf16_split_block, _int8_split_block
    global _hash32, _high16, _sr_bf16, _abs_bits, _encode_m8, _encode_v8, _decode_m8, _decode_v8
    import numba
    from llvmlite import ir as llvm_ir  # type: ignore[import-untyped]  # llvmlite ships no type information
    from numba.core import types
    from numba.extending import intrinsic

    _adamw_kernels.kernels()  # binds _adamw_kernels' jitted element helpers first

    @intrinsic
    def bits_f32(typingctx: BaseContext, u: types.Type) -> Typing:
        """The low 32 bits of a uint64 as fp32."""
        if u != types.uint64:
            return None

        def codegen(
            context: Any, builder: llvm_ir.IRBuilder, signature: Signature, args: Sequence[llvm_ir.Value]
        ) -> llvm_ir.Value:
            return builder.bitcast(builder.trunc(args[0], llvm_ir.IntType(32)), llvm_ir.FloatType())

        return types.float32(u), codegen

    inline = numba.njit(inline="always", fastmath=False, nogil=True)

    _adam, _as_fp32, _prange = _adamw_kernels._adam, _adamw_kernels._as_fp32, numba.prange
    t = numba_twins()
    _hash32, _high16, _sr_bf16, _abs_bits = t.hash32, t.high16, t.sr_bf16, t.abs_bits
    _encode_m8, _encode_v8, _decode_m8, _decode_v8 = t.encode_m8, t.encode_v8, t.decode_m8, t.decode_v8
    _bits_f32 = _as_stand_in(bits_f32, _bits_f32_py)
    _bf16_block, _int8_block, _int8_encode = inline(_bf16_block_py), inline(_int8_block_py), inline(_int8_encode_py)
    _int8_run, _hash_run, _int8_scales = inline(_int8_run_py), inline(_hash_run_py), inline(_int8_scales_py)
    _load_master, _store_master = _adamw_kernels._load_master, _adamw_kernels._store_master
    _read_ties, _write_ties = _adamw_kernels._read_ties, _adamw_kernels._write_ties
    _bf16_split_block, _int8_split_block = inline(_bf16_split_block_py), inline(_int8_split_block_py)

    kernel = numba.njit(parallel=True, fastmath=False, nogil=True, cache=True)
    step: dict[tuple[str, MasterFormat], RangeKernel] = {  # by (MomentCodec.name, MasterRange.format)
        ("bf16", "fp32"): kernel(_adamw_bf16_py),
        ("int8", "fp32"): kernel(_adamw_int8_py),
        ("bf16", "split"): kernel(_adamw_bf16_split_py),
        ("int8", "split"): kernel(_adamw_int8_split_py),
    }
    return CompactKernels(step=MappingProxyType(step))


class DeviceKernel(Protocol):
    """A one-pass compact AdamW step of one device range (see :attr:`CompactAdamW.device_kernel`)."""

    def __call__(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        scalars: tuple[Any, ...],
        grad_scale: float,
        index0: int,
        key: tuple[int, int],
    ) -> bool: ...


class CompactAdamW(AdamWOptimizer):
    """AdamW (decoupled weight decay on ranges flagged ``decay``) with moments stored by ``codec`` (bf16 or
    int8; by default the codec ``config.state_format`` names), rounded stochastically with seed
    ``config.state_seed``.

    ``fused``: True runs host ranges through the numba kernels (an error without numba), False through
    the torch ops, None (default) picks numba when it imports. Device ranges always take the torch ops, in
    chunks of ``chunk_numel`` (a multiple of the int8 block). ``threads`` caps numba's threads, as for
    ``FusedAdamW``. The master may be an fp32 range or a split one (``SplitMaster``); both number their
    elements by slab position (``MasterRange.index0``), so the hash, and the stored moments, are the same
    for either.
    """

    def __init__(
        self,
        config: AdamWConfig,
        *,
        codec: MomentCodec | None = None,
        threads: int | None = None,
        fused: bool | None = None,
        chunk_numel: int = CHUNK_NUMEL,
        device_kernel: DeviceKernel | None = None,
    ) -> None:
        super().__init__(config, correction_piece_numel=min(chunk_numel, DEFAULT_PIECE_NUMEL))
        self.device_kernel = device_kernel
        """A one-pass step for ranges off the host (slide_kernels.ops.compact_adamw.adamw_compact_moments, which
        the `slide` commands attach when slide-kernels and Triton are installed); None, or a range it
        declines: the torch path."""
        self.codec = moment_codec(config.state_format) if codec is None else codec
        if isinstance(self.codec, Fp32Moments):
            raise ValueError(f"CompactAdamW stores bf16 or int8 moments, not {self.codec.name!r}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if chunk_numel < QUANT_BLOCK or chunk_numel % QUANT_BLOCK:
            raise ValueError(f"chunk_numel must be a positive multiple of {QUANT_BLOCK}, got {chunk_numel}")
        if fused and not FusedAdamW.available():
            raise RuntimeError("the fused compact AdamW needs numba (pip install numba)")
        self.fused = FusedAdamW.available() if fused is None else fused
        self.threads = threads
        self.chunk_numel = chunk_numel
        self.arrays: tuple[StateArray, ...] = self.codec.arrays()
        self.state_names = tuple(a.name for a in self.arrays)
        fp32_config = dataclasses.replace(config, state_format="fp32")
        self._fp32 = TorchAdamW(fp32_config, chunk_numel=chunk_numel)
        self._threads = FusedAdamW(fp32_config, threads=threads)
        self._moments: dict[torch.device, torch.Tensor] = {}  # one chunk's fp32 m and v, per device
        self._grads: dict[torch.device, torch.Tensor] = {}  # one chunk's fp32 applied gradient (corrections)
        self._flags = np.empty(0, dtype=np.uint8)  # a split master's unpacked tie bits, one byte per element
        self._reserved = 0

    @property
    def format(self) -> str:
        """The moments' format by name (the codec's)."""
        return self.codec.name

    @property
    def state_format(self) -> str:
        return self.codec.name

    @property
    def state_arrays(self) -> tuple[StateArray, ...]:
        return self.arrays

    def device_replica(self) -> CompactAdamW:
        """Device ranges run the torch ops (numba runs on the host only)."""
        return CompactAdamW(
            self.config, codec=self.codec, fused=False, chunk_numel=self.chunk_numel, device_kernel=self.device_kernel
        )

    def device_scratch_bytes(self, max_range_numel: int, *, corrects: bool = False) -> int:
        """The torch path's peak on a device, one chunk's worth: fp32 m and v, ``TorchAdamW``'s gradient and
        ``denom``, and the largest of the codec's temporaries (``MomentCodec.scratch_bytes``); with
        ``corrects`` also the correction's applied gradient and ``AdamWCorrection``'s two pieces (the codec's
        temporaries again, at a time the step's are gone)."""
        if max_range_numel <= 0:
            return 0
        chunk = min(max_range_numel, self.chunk_numel)
        held = 2 * 4 * chunk + self._fp32.device_scratch_bytes(chunk)
        if corrects:
            held += 4 * chunk + self._correction.scratch_bytes(chunk)
        return held + self.codec.scratch_bytes(chunk)

    def host_scratch_bytes(self, max_range_numel: int, *, corrects: bool = False, split_master: bool = False) -> int:
        """The fused kernels: a split master's unpacked tie bits over the reserved range. The torch path:
        one chunk's fp32 m and v and ``TorchAdamW``'s own scratch for a chunk. With ``corrects`` (always the
        torch ops): one chunk's m and v (shared with the torch path's step), its applied gradient and
        ``AdamWCorrection``'s pieces."""
        if max_range_numel <= 0:
            return 0
        chunk = min(max_range_numel, self.chunk_numel)
        if self.fused:
            held = max_range_numel if split_master else 0
        else:
            held = 2 * 4 * chunk + self._fp32.host_scratch_bytes(chunk, split_master=split_master)
        if corrects:
            held += (2 * 4 * chunk if self.fused else 0) + 4 * chunk
            held += self._correction.host_scratch_bytes(chunk, split_master=split_master)
        return held

    def reserve(self, max_range_numel: int, device: torch.device | str = "cpu") -> None:
        """Remember the largest range: the torch path's fp32 moment scratch (and a correction's) is
        allocated for one chunk of it when first needed, never by the fused path."""
        self._reserved = max(self._reserved, max_range_numel)
        if not self.fused or torch.device(device).type != "cpu":  # the fused kernels need no fp32 scratch
            self._fp32.reserve(min(max_range_numel, self.chunk_numel), device)

    def _chunks(self, numel: int) -> range:
        return range(0, numel, self.chunk_numel)

    def _held(
        self, buffers: dict[torch.device, torch.Tensor], count: int, numel: int, device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        """``count`` fp32 buffers of ``numel`` (at most a chunk) from a scratch kept per device, allocated at
        the largest chunk this instance will see (its reserved range's, or this one)."""
        held = buffers.get(device)
        if held is None or held.numel() < count * numel:
            size = max(numel, min(self._reserved, self.chunk_numel))
            held = buffers[device] = torch.empty(count * size, dtype=torch.float32, device=device)
        return tuple(held[i * numel : (i + 1) * numel] for i in range(count))

    def warmup(self) -> None:
        """Compile (or load) this format's kernels for bf16 and fp32 gradients, fp32 and split masters, on
        a tiny range (off the training critical path). Keeps no scratch: the split master's tie flags it
        needed go, so a run holds only what its own ranges need (``host_scratch_bytes``)."""
        if not self.fused:
            return
        n = QUANT_BLOCK
        split = SplitMaster(
            torch.ones(n, dtype=torch.bfloat16),
            torch.zeros(n, dtype=torch.int16),
            torch.zeros(n // 8, dtype=torch.uint8),
        )
        for master in (torch.ones(n), split):  # an fp32 master, and the split one bf16 runs hold by default
            for dtype in (torch.bfloat16, torch.float32):
                state = {a.name: torch.zeros(a.numel(n), dtype=a.dtype) for a in self.arrays}
                self.step(master, torch.ones(n, dtype=dtype), state, lr=1e-3, step=1, decay=True)
        self._flags = np.empty(0, dtype=np.uint8)

    def _check(self, master: MasterRange, grad: torch.Tensor, state: Mapping[str, torch.Tensor]) -> int:
        n = master.numel()
        for a in self.arrays:
            t = state[a.name]
            if t.dtype != a.dtype or t.numel() != a.numel(n):
                raise ValueError(
                    f"{a.name} must be {a.numel(n)} x {a.dtype} for a range of {n}, got {t.numel()} x {t.dtype}"
                )
        if master.dtype != torch.float32 or grad.numel() != n:
            raise ValueError(f"master must be fp32 and grad of its size ({n}), got {master.dtype}, {grad.numel()}")
        if n % self.codec.block:
            raise ValueError(
                f"{self.codec.name} optimizer state works on whole {self.codec.block}-element blocks, got a range "
                f"of {n}"
            )
        return n

    def step(
        self,
        master: torch.Tensor | MasterRange,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float = 1.0,
    ) -> None:
        master = as_master_range(master)
        n = self._check(master, grad, state)
        if n == 0:
            return
        key = stream_key(self.config.state_seed, step, STEP_SALT)
        if self.fused and master.device.type == "cpu":
            self._fused_step(master, grad, state, key, lr=lr, step=step, decay=decay, grad_scale=grad_scale)
            return
        if self._stepped_by_kernel(master, grad, state, key, lr=lr, step=step, decay=decay, grad_scale=grad_scale):
            return
        index0 = master.index0
        for lo in self._chunks(n):
            hi = min(n, lo + self.chunk_numel)
            m, v = self._held(self._moments, 2, hi - lo, master.device)
            codes = slice_state(self.arrays, state, lo, hi)
            self.codec.decode(codes, m, v)
            moments = {"exp_avg": m, "exp_avg_sq": v}
            self._fp32.step(master[lo:hi], grad[lo:hi], moments, lr=lr, step=step, decay=decay, grad_scale=grad_scale)
            self.codec.encode(m, v, codes, index0=index0 + lo, key=key)

    def _stepped_by_kernel(
        self,
        master: MasterRange,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        key: tuple[int, int],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float,
    ) -> bool:
        """Whether :attr:`device_kernel` took the step of this device range (an fp32 master)."""
        if self.device_kernel is None or master.device.type == "cpu" or master.format != "fp32":
            return False
        scalars = _adamw_kernels.step_scalars(self.config, lr, step, decay)
        return self.device_kernel(
            master.values(), grad, state, scalars=scalars, grad_scale=grad_scale, index0=master.index0, key=key
        )

    def _fused_step(
        self,
        master: MasterRange,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        key: tuple[int, int],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float,
    ) -> None:
        with _compile_lock:
            kernels = _kernels()
        self._threads._kernels()  # applies ``threads`` (numba's thread count is per calling thread)
        args = _adamw_kernels.step_scalars(self.config, lr, step, decay)  # exactly FusedAdamW.step's scalars
        g = _adamw_kernels.grad_array(grad if grad.dtype in (torch.bfloat16, torch.float32) else grad.float())
        index = (np.int64(master.index0), np.uint32(key[0]), np.uint32(key[1]), np.float32(grad_scale))
        moments = tuple(_moment_array(state[a.name], a.name) for a in self.arrays)
        n = master.kernel_flags_numel()
        if self._flags.shape[0] < n:
            self._flags = np.empty(max(n, self._reserved), dtype=np.uint8)
        operands = master.kernel_operands(self._flags)
        kernels.step[(self.codec.name, master.format)](*operands, g, *moments, *index, *args)

    def correct(
        self,
        master: torch.Tensor | MasterRange,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        applied: Coefficient,
        correction: Correction,
        lr: float,
        step: int,
        decay: bool,
    ) -> None:
        """Decode, correct in fp32 (``AdamWOptimizer.correct``), encode with the correction's own hash stream.

        At step 1 the moments before the update were zero, so the ones it divided by are rebuilt exactly
        from the gradient it applied (the same torch ops as ``TorchAdamW``'s, which the kernels match)
        instead of from their stored rounding: a first step, often clipped, is then taken back as exactly
        as with fp32 state. Later steps start from the stored moments (exact to the format's rounding)."""
        if correction.kind == "keep":
            return
        master = as_master_range(master)
        n = self._check(master, grad, state)
        index0 = master.index0
        key = stream_key(self.config.state_seed, step, CORRECTION_SALT)
        for lo in self._chunks(n):
            hi = min(n, lo + self.chunk_numel)
            m, v = self._held(self._moments, 2, hi - lo, master.device)
            codes = slice_state(self.arrays, state, lo, hi)
            if step == 1:
                (g,) = self._held(self._grads, 1, hi - lo, master.device)
                scale_into(g, grad[lo:hi], applied)
                m.zero_().lerp_(g, 1.0 - self.config.beta1)
                v.zero_().mul_(self.config.beta2).addcmul_(g, g, value=1.0 - self.config.beta2)
            else:
                self.codec.decode(codes, m, v)
            moments = {"exp_avg": m, "exp_avg_sq": v}
            super().correct(
                master[lo:hi], grad[lo:hi], moments, applied=applied, correction=correction, lr=lr, step=step,
                decay=decay,
            )  # fmt: skip
            self.codec.encode(m, v, codes, index0=index0 + lo, key=key)


def _moment_array(t: torch.Tensor, name: str) -> np.ndarray:
    """A stored moment array as the kernels take it (bf16 as its raw 16-bit words)."""
    if t.dtype == torch.bfloat16:
        return kernel_array(t.view(torch.int16), name).view(np.uint16)
    return kernel_array(t, name)
