"""AdamW with compact moments (bf16, or int8 codes with a scale per 64 elements) in one pass over device
memory: the update of a GPU-resident or GPU-streamed unit.

Why: the compact optimizer's torch path (slide_core/optim/compact_adamw.py) widens a chunk of moments into
fp32 scratch, steps it with torch's fused AdamW, then rounds it back with the position-keyed hash spelled
in int64 torch ops: some thirty passes over memory per chunk. On an H200 that took ~110 ms for one
218M-parameter block of Llama-3.1-8B, against ~4 ms for fp32 moments, and made bf16 state slower than
fp32 on the GPU. These kernels read the gradient, the fp32 master and the two moments once and write
master and moments once (14 bytes per parameter with a bf16 gradient and bf16 moments, about 14.25 with int8:
the codes and the block scales read and written).

The arithmetic is the host kernel's, op for op (``_adam`` in slide_core/optim/_adamw_kernels.py): the
lerp as one fused multiply-add from the end torch's lerp starts from, the second moment as one fused
multiply-add, a correctly rounded square root and divisions, the weight decay as a separate multiply
and add (the launch turns off the compiler's own contraction). The moments are rounded stochastically
with :func:`slide_core.optim.state_formats.element_bits` of each element's master position, so a unit's
moments are the host's whichever side updates it. The scalars are
:func:`slide_core.optim._adamw_kernels.step_scalars`' (torch.optim.AdamW's roundings).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from slide_kernels._backend import tl, triton, use_triton

__all__ = ["BLOCK", "INT8_BLOCKS", "adamw_compact_moments"]

BLOCK = 1024
"""Elements per program (bf16 moments)."""

QUANT_BLOCK = 64
"""Elements per int8 scale (slide_core.optim.state_formats.QUANT_BLOCK)."""

INT8_BLOCKS = 16
"""Scale blocks per program (int8 moments): 1024 elements."""


@triton.jit
def _mix32(x):
    """state_formats.mix32 on uint32 lanes (multiplication wraps at 32 bits)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _sr_bf16(x, rand16):
    """fp32 -> bf16 bits (uint32 lanes holding 16 bits), rounded up when the dropped half plus ``rand16``
    carries: state_formats._sr_bf16_t, infinities and overflow truncated, NaN kept quiet."""
    u = x.to(tl.uint32, bitcast=True)
    up = (u + rand16) >> 16
    trunc = u >> 16
    nonfinite = (u & 0x7F800000) == 0x7F800000
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    overflow = (up & 0x7F80) == 0x7F80
    out = tl.where(nonfinite | overflow, trunc, up)
    return tl.where(nan, trunc | 0x40, out)


@triton.jit
def _widen_bf16(bits):
    """bf16 bits (int16 lanes) -> fp32, exactly."""
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _adamw_bf16_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    n,
    index0,
    k0,
    k1,
    scale,
    decay,
    coeff,
    beta2,
    one_minus_beta2,
    bc2_sqrt,
    eps,
    neg_step,
    LARGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
    m = _widen_bf16(tl.load(m_ptr + offs, mask=mask, other=0))
    v = _widen_bf16(tl.load(v_ptr + offs, mask=mask, other=0))
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.fma(coeff, g - m, g if LARGE else m)  # torch's lerp, from the end it starts from
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p * decay + tl.div_rn(neg_step * m, denom)
    index = index0 + offs
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    bits = _mix32(_mix32(lo ^ k0.to(tl.uint32)) ^ hi ^ k1.to(tl.uint32))
    m_bits = _sr_bf16(m, bits & 0xFFFF)
    v_bits = _sr_bf16(v, bits >> 16)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m_bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    tl.store(v_ptr + offs, v_bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


@triton.jit
def _decode_fp8(mag, scale, MANTISSA: tl.constexpr, TINY: tl.constexpr):
    """An 8-bit float code's magnitude times its block's scale (state_formats._decode_int8_t)."""
    normal = ((mag + (112 << MANTISSA)) << (23 - MANTISSA)).to(tl.uint32).to(tl.float32, bitcast=True)
    tiny = mag.to(tl.float32) * TINY  # 2 ** -(14 + MANTISSA): the subnormal grid
    return tl.where(mag >= (1 << MANTISSA), normal, tiny) * scale


@triton.jit
def _encode_fp8(x, inv, rand16, MANTISSA: tl.constexpr, FIXED: tl.constexpr, KEEP_POSITIVE: tl.constexpr):
    """|x| / scale as an 8-bit float code's magnitude (int32 lanes), rounded stochastically by ``rand16``
    (state_formats._encode_int8_t): the normal range by adding the random bits under the kept mantissa,
    the subnormal grid by a fixed-point rounding."""
    r = tl.minimum(tl.abs(x) * inv, 1.0)
    u = r.to(tl.uint32, bitcast=True)
    normal = ((u + (rand16 << (7 - MANTISSA))) >> (23 - MANTISSA)).to(tl.int32) - (112 << MANTISSA)
    fixed = (r * FIXED).to(tl.int64)  # FIXED = 2 ** (30 + MANTISSA): subnormal grid steps x 2 ** 16
    low = ((fixed + rand16.to(tl.int64)) >> 16).to(tl.int32)
    if KEEP_POSITIVE:
        low = tl.where((x > 0) & (low == 0), 1, low)
    return tl.where(u >= (113 << 23), normal, low)


@triton.jit
def _adamw_int8_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    ms_ptr,
    vs_ptr,
    n_blocks,
    index0,
    k0,
    k1,
    scale,
    decay,
    coeff,
    beta2,
    one_minus_beta2,
    bc2_sqrt,
    eps,
    neg_step,
    LARGE: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    block_mask = blocks < n_blocks
    offs = blocks[:, None] * 64 + tl.arange(0, 64)[None, :]
    mask = block_mask[:, None] & (tl.arange(0, 64)[None, :] < 64)
    m_scale = tl.load(ms_ptr + blocks, mask=block_mask, other=0.0)
    v_scale = tl.load(vs_ptr + blocks, mask=block_mask, other=0.0)
    m_code = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32)
    v_code = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32)
    m_mag = _decode_fp8(tl.abs(m_code), m_scale[:, None], 3, 7.62939453125e-06)  # 2 ** -17
    m = tl.where(m_code < 0, -m_mag, m_mag)
    v = _decode_fp8(v_code, v_scale[:, None], 4, 3.814697265625e-06)  # 2 ** -18
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.fma(coeff, g - m, g if LARGE else m)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p * decay + tl.div_rn(neg_step * m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    m_max = tl.max(tl.abs(m), axis=1)
    v_max = tl.max(tl.abs(v), axis=1)
    m_inv = tl.where(m_max > 0, tl.div_rn(tl.full(m_max.shape, 1.0, tl.float32), m_max), 0.0)
    v_inv = tl.where(v_max > 0, tl.div_rn(tl.full(v_max.shape, 1.0, tl.float32), v_max), 0.0)
    index = index0 + offs
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    bits = _mix32(_mix32(lo ^ k0.to(tl.uint32)) ^ hi ^ k1.to(tl.uint32))
    m_mag = _encode_fp8(m, m_inv[:, None], bits & 0xFFFF, 3, 8589934592.0, False)  # 2 ** 33
    v_mag = _encode_fp8(v, v_inv[:, None], bits >> 16, 4, 17179869184.0, True)  # 2 ** 34
    tl.store(m_ptr + offs, tl.where(m < 0, -m_mag, m_mag).to(tl.int8), mask=mask)
    tl.store(v_ptr + offs, v_mag.to(tl.uint8), mask=mask)
    tl.store(ms_ptr + blocks, m_max, mask=block_mask)
    tl.store(vs_ptr + blocks, v_max, mask=block_mask)


def adamw_compact_moments(
    master: torch.Tensor,
    grad: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    *,
    scalars: tuple,
    grad_scale: float,
    index0: int,
    key: tuple[int, int],
) -> bool:
    """Step ``master`` (fp32) with ``grad`` (bf16 or fp32) and the compact moments in ``state`` (bf16
    ``exp_avg``/``exp_avg_sq``, or int8/uint8 codes with their ``*_scale`` arrays) in place; ``scalars``:
    ``step_scalars(config, lr, step, decay)``; ``index0``: the master position of ``master[0]``; ``key``:
    the step's ``stream_key``. Returns False, touching nothing, where Triton cannot run on these tensors or
    the state is in neither format (the caller then takes the torch path)."""
    if not use_triton(master) or master.dtype != torch.float32 or grad.dtype not in (torch.bfloat16, torch.float32):
        return False
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if m.dtype == torch.bfloat16 and v.dtype == torch.bfloat16:
        return _bf16(master, grad, m, v, scalars=scalars, grad_scale=grad_scale, index0=index0, key=key)
    if m.dtype == torch.int8 and v.dtype == torch.uint8:
        scales = (state["exp_avg_scale"], state["exp_avg_sq_scale"])
        return _int8(master, grad, m, v, *scales, scalars=scalars, grad_scale=grad_scale, index0=index0, key=key)
    return False


def _int8(
    master: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    m_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    scalars: tuple,
    grad_scale: float,
    index0: int,
    key: tuple[int, int],
) -> bool:
    n = master.numel()
    tensors = (master, grad, m, v, m_scale, v_scale)
    if n % QUANT_BLOCK or not all(t.is_contiguous() for t in tensors) or {grad.numel(), m.numel(), v.numel()} != {n}:
        return False
    if m_scale.numel() != n // QUANT_BLOCK or v_scale.numel() != n // QUANT_BLOCK:
        return False
    if n == 0:
        return True
    decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step = scalars
    n_blocks = n // QUANT_BLOCK
    with torch.cuda.device(master.device) if master.is_cuda else contextlib.nullcontext():
        _adamw_int8_kernel[(triton.cdiv(n_blocks, INT8_BLOCKS),)](
            master, grad, m, v, m_scale, v_scale, n_blocks, index0, key[0], key[1],
            float(grad_scale), float(decay), float(coeff), float(beta2), float(one_minus_beta2), float(bc2_sqrt),
            float(eps), float(neg_step), LARGE=bool(large), BLOCKS=INT8_BLOCKS, enable_fp_fusion=False,
        )  # fmt: skip
    return True


def _bf16(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    scalars: tuple,
    grad_scale: float,
    index0: int,
    key: tuple[int, int],
) -> bool:
    tensors = (master, grad, exp_avg, exp_avg_sq)
    if not all(t.is_contiguous() for t in tensors) or len({t.numel() for t in tensors}) != 1:
        return False
    n = master.numel()
    if n == 0:
        return True
    decay, coeff, large, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step = scalars
    with torch.cuda.device(master.device) if master.is_cuda else contextlib.nullcontext():
        _adamw_bf16_kernel[(triton.cdiv(n, BLOCK),)](
            master, grad, exp_avg.view(torch.int16), exp_avg_sq.view(torch.int16), n, index0, key[0], key[1],
            float(grad_scale), float(decay), float(coeff), float(beta2), float(one_minus_beta2), float(bc2_sqrt),
            float(eps), float(neg_step), LARGE=bool(large), BLOCK=BLOCK, enable_fp_fusion=False,
        )  # fmt: skip
    return True
