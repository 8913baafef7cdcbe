"""Rotary position embedding (RoPE) for q and k in HF's ``rotate_half`` convention.

``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``,
q of shape ``(B, Hq, S, D)``, k of shape ``(B, Hk, S, D)``, cos/sin of shape ``(B, S, D)`` (or
``(1, S, D)`` / ``(S, D)``, broadcast over the batch). One program handles one ``(batch, position)``
token: it loads that token's cos/sin row once and rotates every q head and every k head of it, so q
and k cost one read and one write each, and cos/sin are read once per token instead of once per head.

Strides are passed explicitly, so the non-contiguous q/k that HF gets from
``view(B, S, H, D).transpose(1, 2)`` are read in place, without a ``.contiguous()`` copy; outputs
keep the input's memory layout. Backward applies the transposed (for HF cos/sin: inverse) rotation
``dx = dy * cos + rotate_half^T(dy * sin)``. cos and sin get no gradient.
"""

from __future__ import annotations

import torch

from slide_kernels._backend import num_warps_for, tl, triton, use_triton

__all__ = ["apply_rotary", "rope_backward", "rope_forward"]


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _rotate_heads(
    in_ptr,
    out_ptr,
    in_sb,
    in_sh,
    in_ss,
    out_sb,
    out_sh,
    out_ss,
    b,
    s,
    n_heads,
    c1,
    c2,
    s1,
    s2,
    half,
    BACKWARD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (dims < half)
    src = in_ptr + b * in_sb + s * in_ss + heads * in_sh + dims
    dst = out_ptr + b * out_sb + s * out_ss + heads * out_sh + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # transpose of [x*cos + rotate_half(x)*sin]:  [dy1*c1 + dy2*s2, dy2*c2 - dy1*s1]
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(dst, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, y2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    cos_ptr,
    sin_ptr,
    q_sb,
    q_sh,
    q_ss,
    k_sb,
    k_sh,
    k_ss,
    qo_sb,
    qo_sh,
    qo_ss,
    ko_sb,
    ko_sh,
    ko_ss,
    cs_sb,
    cs_ss,
    sn_sb,
    sn_ss,
    seq_len,
    n_q_heads,
    n_k_heads,
    half,
    BACKWARD: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    b = token // seq_len
    s = token % seq_len
    dims = tl.arange(0, BLOCK_D)[None, :]
    dmask = dims < half
    cos_row = cos_ptr + b * cs_sb + s * cs_ss + dims
    sin_row = sin_ptr + b * sn_sb + s * sn_ss + dims
    c1 = tl.load(cos_row, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + half, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + half, mask=dmask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, qo_ptr, q_sb, q_sh, q_ss, qo_sb, qo_sh, qo_ss, b, s, n_q_heads, c1, c2, s1, s2, half,
        BACKWARD, BLOCK_QH, BLOCK_D,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, ko_ptr, k_sb, k_sh, k_ss, ko_sb, ko_sh, ko_ss, b, s, n_k_heads, c1, c2, s1, s2, half,
        BACKWARD, BLOCK_KH, BLOCK_D,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# torch fallback
# ----------------------------------------------------------------------------------------------
def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)  # (B, 1, S, D)
    x1, x2 = xf[..., :half], xf[..., half:]
    c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    if backward:
        y = torch.cat((x1 * c1 + x2 * s2, x2 * c2 - x1 * s1), dim=-1)
    else:
        y = torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)
    out = torch.empty_like(x)  # keeps x's memory layout
    out.copy_(y)
    return out


# ----------------------------------------------------------------------------------------------
# launchers (no autograd)
# ----------------------------------------------------------------------------------------------
def _prepare(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError("q and k must be (batch, heads, seq, head_dim)")
    bsz, _, seq, dim = q.shape
    if k.shape[0] != bsz or k.shape[2] != seq or k.shape[3] != dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch, seq or head_dim")
    if dim % 2:
        raise ValueError(f"head_dim must be even, got {dim}")
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if cos.shape[-2:] != (seq, dim) or cos.shape[0] not in (1, bsz) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be (batch or 1, seq, head_dim), got {tuple(cos.shape)}")
    return cos.expand(bsz, seq, dim), sin.expand(bsz, seq, dim)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = _prepare(q, k, cos, sin)
    if not use_triton(q):
        return _rotate_torch(q, cos, sin, backward), _rotate_torch(k, cos, sin, backward)
    # the kernel assumes unit stride along head_dim; anything else is copied once
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    bsz, n_q, seq, dim = q.shape
    n_k = k.shape[1]
    half = dim // 2
    block_d = triton.next_power_of_2(half)
    block_qh = triton.next_power_of_2(n_q)
    block_kh = triton.next_power_of_2(n_k)
    if bsz * seq:
        _rope_kernel[(bsz * seq,)](
            q, k, q_out, k_out, cos, sin,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            q_out.stride(0), q_out.stride(1), q_out.stride(2),
            k_out.stride(0), k_out.stride(1), k_out.stride(2),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            seq, n_q, n_k, half,
            BACKWARD=backward, BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_D=block_d,
            num_warps=num_warps_for(block_qh * block_d),
        )  # fmt: skip
    return q_out, k_out


def rope_forward(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k without autograd; returns ``(q_rot, k_rot)`` in the inputs' memory layout."""
    return _launch(q, k, cos, sin, backward=False)


def rope_backward(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`apply_rotary` w.r.t. q and k: the transposed rotation of ``dq``, ``dk``."""
    return _launch(dq, dk, cos, sin, backward=True)


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------
class RotaryFunction(torch.autograd.Function):
    """Autograd glue for :func:`apply_rotary`: keeps cos and sin only."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q_out, k_out = rope_forward(q, k, cos, sin)
        ctx.save_for_backward(cos, sin)
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = rope_backward(dq, dk, cos, sin)
        return dq_in, dk_in, None, None


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to q ``(B, Hq, S, D)`` and k ``(B, Hk, S, D)`` with HF's ``rotate_half`` layout.

    Why: eager HF RoPE builds ``rotate_half`` copies and four temporaries per tensor, forward and
    backward; this reads and writes q and k once each way and reads cos/sin once per token. Hq may
    differ from Hk (GQA); q and k may be non-contiguous (HF's transposed views). Returns new tensors;
    q and k are not modified. cos/sin (``(B, S, D)``, ``(1, S, D)`` or ``(S, D)``) get no gradient.
    """
    return RotaryFunction.apply(q, k, cos, sin)
