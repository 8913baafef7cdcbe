"""AdamW with bf16 moments in one pass over device memory: the update of a GPU-resident or GPU-streamed unit.

Why: the compact optimizer's torch path (slide_core/optim/compact_adamw.py) widens a chunk of moments into
fp32 scratch, steps it with torch's fused AdamW, then rounds it back with the position-keyed hash spelled
in int64 torch ops: some thirty passes over memory per chunk. On an H200 that took ~110 ms for one
218M-parameter block of Llama-3.1-8B, against ~4 ms for fp32 moments, and made bf16 state slower than
fp32 on the GPU. This kernel reads the gradient, the fp32 master and the two bf16 moments once and
writes master and moments once (14 bytes per parameter with a bf16 gradient).

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

import torch

from slide_kernels._backend import tl, triton, use_triton

__all__ = ["BLOCK", "adamw_bf16_moments"]

BLOCK = 1024
"""Elements per program."""


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


def adamw_bf16_moments(
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
    """Step ``master`` (fp32) with ``grad`` (bf16 or fp32) and the bf16 moments in place; ``scalars``:
    ``step_scalars(config, lr, step, decay)``; ``index0``: the master position of ``master[0]``; ``key``:
    the step's ``stream_key``. Returns False, touching nothing, where Triton cannot run on these tensors
    (the caller then takes the torch path)."""
    tensors = (master, grad, exp_avg, exp_avg_sq)
    if not use_triton(master) or master.dtype != torch.float32 or grad.dtype not in (torch.bfloat16, torch.float32):
        return False
    if exp_avg.dtype != torch.bfloat16 or exp_avg_sq.dtype != torch.bfloat16:
        return False
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
