"""Fused LM head + cross-entropy that never materializes the ``(N, V)`` logits.

At Llama-3 shapes (16K tokens, H=4096, V=128256, bf16) eager ``F.cross_entropy(h @ W.T)`` holds the
4.2 GB bf16 logits, an 8.4 GB fp32 upcast and its log-softmax, and as much again in backward. Here the
tokens are processed in chunks of ``C`` rows; for each chunk:

1. ``logits = h_c @ W.T (+ bias)`` with a plain matmul in the compute dtype, into one reused
   ``(C, V)`` buffer;
2. a Triton kernel walks each row once to get the max / log-sum-exp online (fp32, after the optional
   Gemma-2 style softcap ``softcap * tanh(z / softcap)``), writes the row's loss (with torch's label
   smoothing), and walks it again to write ``dloss/dlogits`` **in place** over the logits;
3. ``grad_h_c = dlogits @ W``, ``grad_W += dlogits.T @ h_c`` (``addmm_`` into one preallocated
   buffer), ``grad_b += dlogits.sum(0)``.

``row_weight`` (optional, one fp32 number per row) scales each row's loss and its gradient: a weighted
cross-entropy ``sum_t w_t CE_t`` whose weights may be negative. A preference loss (DPO, SimPO) runs as one,
with each token weighted by the loss's derivative with respect to its completion's log-probability
(slide-hf's preference head). ``rows_out`` receives the per-row losses (weighted when weights are given).

So all the gradients are computed in the *forward*, which is what the SlideFormer engine wants (it
can ship the head's gradients out as soon as the loss is known), and the backward only scales them by
the incoming ``grad_output`` in place (no ``.item()``, no host sync). ``reduction="mean"`` divides by
the number of non-ignored targets, counted on the device; with every target ignored the loss and all
gradients are 0 (torch would give NaN).

Memory (extra over the inputs): ``grad_W`` (V x H in the accumulation dtype, the weight's dtype by
default), ``grad_h`` (N x H), one ``(C, V)`` logits buffer in the compute dtype and O(N) fp32 scalars.
``C`` comes from :data:`CHUNK_LOGITS_BYTES`. Accumulating ``grad_W`` in fp32 instead
(``accum_dtype=torch.float32``) doubles its footprint for bf16 weights (2 GB at Llama-3-8B shapes),
so it is opt-in; the default rounds once per chunk into the bf16 buffer, as Liger-Kernel does, while
each chunk's matmul itself accumulates in fp32.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from slide_kernels._backend import num_warps_for, tl, triton, use_triton

__all__ = [
    "CHUNK_LOGITS_BYTES",
    "linear_cross_entropy",
    "linear_cross_entropy_backward",
    "linear_cross_entropy_forward",
]

#: Byte budget of one chunk's logits buffer (in the compute dtype); ``SLIDE_KERNELS_CE_CHUNK_MIB``
#: overrides it. 256 MiB gives 1024-row chunks at V=128256 in bf16: the ``grad_W += dlogits.T @ h``
#: update then has K=1024, which is what makes it ~10% faster than Liger-Kernel's 512-row chunks on an
#: H200. 128 MiB (512 rows) matches Liger's memory to the byte, at Liger's speed (docs/kernels.md).
CHUNK_LOGITS_BYTES = 256 * 2**20
_MAX_BLOCK_V = 8192  # vocab columns a program holds per step
_SCALE_BLOCK = 4096

Reduction = Literal["mean", "sum"]


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _ce_rows_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    loss_ptr,
    n_valid_ptr,
    row_weight_ptr,
    n_cols,
    ignore_index,
    softcap,
    label_smoothing,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_ROW_WEIGHT: tl.constexpr,
    MEAN: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    y = tl.load(target_ptr + row)
    if y == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if WRITE_GRAD:
            for off in range(0, n_cols, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                tl.store(row_ptr + cols, tl.zeros([BLOCK], dtype=row_ptr.dtype.element_ty), mask=cols < n_cols)
        return

    # pass 1: online max / sum-exp (and the plain sum for label smoothing), all in fp32
    m = float("-inf")
    d = 0.0
    z_sum = 0.0
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
        if HAS_SMOOTHING:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)

    y_ok = (y >= 0) & (y < n_cols)  # out-of-range targets are undefined behaviour; don't read out of bounds
    z_y = tl.load(row_ptr + y, mask=y_ok, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z_y = softcap * _tanh(z_y / softcap)
    if HAS_SMOOTHING:  # noqa: SIM108 (plain if/else reads better in a Triton kernel)
        # (1-eps) * (lse - z_y) + eps * mean_j(lse - z_j)
        loss = lse - (1.0 - label_smoothing) * z_y - label_smoothing * z_sum / n_cols
    else:
        loss = lse - z_y
    row_weight = 1.0
    if HAS_ROW_WEIGHT:
        row_weight = tl.load(row_weight_ptr + row).to(tl.float32)
    tl.store(loss_ptr + row, loss * row_weight)

    if WRITE_GRAD:
        if MEAN:  # noqa: SIM108
            scale = 1.0 / tl.maximum(tl.load(n_valid_ptr), 1.0)
        else:
            scale = 1.0
        scale = scale * row_weight
        # pass 2: dloss/dz = softmax - (1-eps) * onehot - eps / V, chained through the softcap
        for off in range(0, n_cols, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = _tanh(x / softcap)
                z = softcap * t
            else:
                z = x
            g = tl.exp(z - lse)
            if HAS_SMOOTHING:
                g = g - label_smoothing / n_cols
                g = tl.where(cols == y, g - (1.0 - label_smoothing), g)
            else:
                g = tl.where(cols == y, g - 1.0, g)
            g = g * scale
            if HAS_SOFTCAP:
                g = g * (1.0 - t * t)
            tl.store(row_ptr + cols, g.to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_inplace_kernel(x_ptr, scale_ptr, n_elements, BLOCK: tl.constexpr):
    # grad_output is read on the device: when it is exactly 1 (the usual case) every program exits
    # after one scalar load, so the common backward moves no gradient bytes and needs no host sync.
    s = tl.load(scale_ptr).to(tl.float32)
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.store(x_ptr + offs, (x.to(tl.float32) * s).to(x_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# per-chunk loss + in-place dlogits: Triton launcher and torch fallback
# ----------------------------------------------------------------------------------------------
def _ce_rows_triton(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss_out: torch.Tensor,
    n_valid: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
    label_smoothing: float,
    mean: bool,
    write_grad: bool,
    row_weight: torch.Tensor | None = None,
) -> None:
    rows, n_cols = logits.shape
    block = min(_MAX_BLOCK_V, triton.next_power_of_2(n_cols))
    _ce_rows_kernel[(rows,)](
        logits, logits.stride(0), target, loss_out, n_valid, row_weight if row_weight is not None else loss_out,
        n_cols, ignore_index, float(softcap or 1.0), float(label_smoothing),
        HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing > 0.0,
        HAS_ROW_WEIGHT=row_weight is not None, MEAN=mean,
        WRITE_GRAD=write_grad, BLOCK=block, num_warps=num_warps_for(block),
    )  # fmt: skip


def _ce_rows_torch(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss_out: torch.Tensor,
    n_valid: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
    label_smoothing: float,
    mean: bool,
    write_grad: bool,
    row_weight: torch.Tensor | None = None,
) -> None:
    n_cols = logits.shape[1]
    z = logits.float()
    if softcap is not None:
        t = torch.tanh(z / softcap)
        z = softcap * t
    lse = torch.logsumexp(z, dim=-1)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(1)
    z_y = z.gather(1, safe_target).squeeze(1)
    loss = lse - (1.0 - label_smoothing) * z_y
    if label_smoothing > 0.0:
        loss = loss - label_smoothing * z.sum(-1) / n_cols
    if row_weight is not None:
        loss = loss * row_weight
    loss_out.copy_(torch.where(valid, loss, torch.zeros_like(loss)))
    if not write_grad:
        return
    g = torch.exp(z - lse.unsqueeze(1))
    if label_smoothing > 0.0:
        g -= label_smoothing / n_cols
    g.scatter_add_(1, safe_target, torch.full_like(z_y, label_smoothing - 1.0).unsqueeze(1))
    row_scale = valid.to(torch.float32)
    if mean:
        row_scale = row_scale / n_valid.clamp(min=1.0)
    if row_weight is not None:
        row_scale = row_scale * row_weight
    g *= row_scale.unsqueeze(1)
    if softcap is not None:
        g *= 1.0 - t * t
    logits.copy_(g)


# ----------------------------------------------------------------------------------------------
# launchers (no autograd)
# ----------------------------------------------------------------------------------------------
def _chunk_rows(n_rows: int, n_vocab: int, element_size: int) -> int:
    env = os.environ.get("SLIDE_KERNELS_CE_CHUNK_MIB")
    budget = int(float(env) * 2**20) if env else CHUNK_LOGITS_BYTES
    rows = max(1, budget // max(1, n_vocab * element_size))
    if rows >= 128:
        rows -= rows % 128  # matmul-friendly
    return max(1, min(rows, n_rows))


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in ``acc``'s dtype without materializing ``a @ b`` separately."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:  # opt-in wider accumulator: upcast the (chunk-sized) operands
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def linear_cross_entropy_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    grad_hidden: bool = True,
    grad_weight: bool = True,
    grad_bias: bool = True,
    accum_dtype: torch.dtype | None = None,
    grad_weight_out: torch.Tensor | None = None,
    grad_bias_out: torch.Tensor | None = None,
    accumulate_grad_out: bool = True,
    row_weight: torch.Tensor | None = None,
    rows_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Loss and the gradients of the loss w.r.t. hidden, weight and bias, without autograd.

    Returns ``(loss, d_hidden, d_weight, d_bias)`` for ``grad_output = 1``; a gradient is ``None`` when
    not asked for (``d_bias`` also when ``bias is None``). ``hidden`` is ``(N, H)``, ``weight``
    ``(V, H)``, ``target`` ``(N,)`` integer class indices.

    ``grad_weight_out`` / ``grad_bias_out`` (engine hook): existing buffers (any float dtype, e.g. a
    persistent fp32 gradient) to *add* this call's weight/bias gradient into, instead of allocating
    new ones; they are then returned as ``d_weight`` / ``d_bias``. With ``accumulate_grad_out=False``
    their old contents are overwritten instead (a buffer in the compute dtype is then written by the
    first chunk's matmul, never zero-filled or read).

    ``row_weight`` ``(N,)``: each row's loss and gradient scaled by it (fp32 math; see the module notes).
    ``rows_out`` ``(N,)`` fp32: where the per-row losses are written (0 for ignored rows).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden (N, H) and weight (V, H), got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    n_rows, n_vocab = hidden.shape[0], weight.shape[0]
    if target.shape != (n_rows,):
        raise ValueError(f"target must have shape ({n_rows},), got {tuple(target.shape)}")
    if bias is not None and bias.shape != (n_vocab,):
        raise ValueError(f"bias must have shape ({n_vocab},), got {tuple(bias.shape)}")
    if row_weight is not None and (row_weight.shape != (n_rows,) or not row_weight.is_floating_point()):
        raise ValueError(f"row_weight must be a float tensor of shape ({n_rows},), got {tuple(row_weight.shape)}")
    if rows_out is not None and (rows_out.shape != (n_rows,) or rows_out.dtype != torch.float32):
        raise ValueError(
            f"rows_out must be an fp32 tensor of shape ({n_rows},), got {rows_out.dtype} {tuple(rows_out.shape)}"
        )

    device, dtype = hidden.device, hidden.dtype
    w = weight if weight.dtype == dtype else weight.to(dtype)  # note: a V x H copy for mixed dtypes
    b = None if bias is None else (bias if bias.dtype == dtype else bias.to(dtype))
    target = target.contiguous()
    grad_bias = grad_bias and bias is not None
    write_grad = grad_hidden or grad_weight or grad_bias
    mean = reduction == "mean"

    loss_rows = rows_out if rows_out is not None else torch.empty(n_rows, dtype=torch.float32, device=device)
    weights = None if row_weight is None else row_weight.to(device=device, dtype=torch.float32).contiguous()
    n_valid = (target != ignore_index).sum(dtype=torch.float32)  # stays on device
    d_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if grad_hidden else None
    d_weight = d_bias = None
    # A fresh weight-gradient buffer in the compute dtype is *written* by the first chunk's matmul
    # (no zero-fill, no read of zeros); a caller's buffer, or a wider one, is accumulated into.
    fresh_gw = False
    if grad_weight:
        if grad_weight_out is not None:
            _check_grad_out("grad_weight_out", grad_weight_out, weight.shape, device)
            d_weight = grad_weight_out
            if not accumulate_grad_out:
                fresh_gw = d_weight.dtype == dtype and d_weight.is_contiguous()
                if not fresh_gw:
                    d_weight.zero_()
        elif (accum_dtype or weight.dtype) == dtype:
            d_weight, fresh_gw = torch.empty(weight.shape, dtype=dtype, device=device), True
        else:
            d_weight = torch.zeros(weight.shape, dtype=accum_dtype or weight.dtype, device=device)
    if grad_bias and bias is not None:  # the second test only narrows the type: grad_bias implies it
        d_bias = grad_bias_out
        if d_bias is None:
            d_bias = torch.zeros(n_vocab, dtype=accum_dtype or bias.dtype, device=device)
        else:
            _check_grad_out("grad_bias_out", d_bias, (n_vocab,), device)
            if not accumulate_grad_out:
                d_bias.zero_()

    rows_fn = _ce_rows_triton if use_triton(hidden) else _ce_rows_torch
    chunk = _chunk_rows(n_rows, n_vocab, hidden.element_size())
    buffer = torch.empty((chunk, n_vocab), dtype=dtype, device=device) if n_rows else None
    for start in range(0, n_rows, chunk):
        end = min(start + chunk, n_rows)
        h_c = hidden[start:end]
        assert buffer is not None  # allocated whenever there are rows
        logits = buffer[: end - start]
        if b is None:
            torch.mm(h_c, w.t(), out=logits)
        else:
            torch.addmm(b, h_c, w.t(), out=logits)
        rows_fn(
            logits, target[start:end], loss_rows[start:end], n_valid,
            ignore_index, softcap, label_smoothing, mean, write_grad,
            None if weights is None else weights[start:end],
        )  # fmt: skip
        # from here on `logits` holds dloss/dlogits
        if d_hidden is not None:
            torch.mm(logits, w, out=d_hidden[start:end])
        if d_weight is not None:
            if fresh_gw and start == 0:
                torch.mm(logits.t(), h_c, out=d_weight)
            else:
                _accumulate(d_weight, logits.t(), h_c)
        if d_bias is not None:
            d_bias += logits.sum(0, dtype=torch.float32).to(d_bias.dtype)
    if fresh_gw and n_rows == 0 and d_weight is not None:  # fresh_gw implies d_weight
        d_weight.zero_()

    loss = loss_rows.sum()
    if mean:
        loss = loss / n_valid.clamp(min=1.0)
    if grad_weight_out is None and d_weight is not None and d_weight.dtype != weight.dtype:
        d_weight = d_weight.to(weight.dtype)
    if grad_bias_out is None and d_bias is not None and bias is not None and d_bias.dtype != bias.dtype:
        d_bias = d_bias.to(bias.dtype)
    return loss, d_hidden, d_weight, d_bias


def _check_grad_out(name: str, buffer: torch.Tensor, shape: tuple[int, ...] | torch.Size, device: torch.device) -> None:
    if tuple(buffer.shape) != tuple(shape) or buffer.device != device or not buffer.is_floating_point():
        raise ValueError(
            f"{name} must be a floating-point tensor of shape {tuple(shape)} on {device}, "
            f"got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}"
        )


def linear_cross_entropy_backward(
    grad_output: torch.Tensor, *grads: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """Scale the gradients computed in the forward by the incoming scalar ``grad_output``, in place.

    In place, so the backward allocates nothing. ``grad_output`` is only read on the device: the
    Triton path skips the pass entirely when it is 1 (no host sync, unlike a ``grad_output == 1``
    check in Python); the fallback multiplies unconditionally.
    """
    out = []
    for g in grads:
        if g is not None:
            if use_triton(g) and g.is_contiguous():
                n = g.numel()
                if n:
                    scale = grad_output.reshape(()).to(torch.float32)
                    _scale_inplace_kernel[(triton.cdiv(n, _SCALE_BLOCK),)](g, scale, n, BLOCK=_SCALE_BLOCK)
            else:
                g.mul_(grad_output)
        out.append(g)
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------
class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd glue for :func:`linear_cross_entropy`: the grads are made in forward, scaled in backward."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None,
        ignore_index: int,
        reduction: Reduction,
        softcap: float | None,
        label_smoothing: float,
        accum_dtype: torch.dtype | None,
        needs: tuple[bool, bool, bool],
        grad_weight_out: torch.Tensor | None,
        row_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        loss, d_hidden, d_weight, d_bias = linear_cross_entropy_forward(
            hidden, weight, target, bias,
            ignore_index=ignore_index, reduction=reduction, softcap=softcap,
            label_smoothing=label_smoothing, grad_hidden=needs[0], grad_weight=needs[1],
            grad_bias=needs[2], accum_dtype=accum_dtype,
            grad_weight_out=grad_weight_out if needs[1] else None, accumulate_grad_out=False,
            row_weight=row_weight,
        )  # fmt: skip
        # scaled in place by the (single) backward
        ctx.save_for_backward(d_hidden, d_weight, d_bias)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if getattr(ctx, "consumed", False):
            raise RuntimeError(
                "linear_cross_entropy: cannot backward through the same graph twice (the gradients are "
                "computed in the forward and scaled in place by the first backward)"
            )
        ctx.consumed = True
        d_hidden, d_weight, d_bias = linear_cross_entropy_backward(grad_output, *ctx.saved_tensors)
        return d_hidden, d_weight, None, d_bias, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    accum_dtype: torch.dtype | None = None,
    grad_weight_out: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of the LM head ``hidden @ weight.T + bias`` without ever holding all the logits.

    Why: at LLM vocab sizes the full ``(N, V)`` logits (and their fp32 upcast and gradient) are the
    largest activation of the whole model; chunking keeps them to one ``(C, V)`` buffer, and the
    gradients are computed in the forward so the backward is a free in-place scale.

    Same value and gradients as ``F.cross_entropy(logits.float(), target, ignore_index=ignore_index,
    reduction=reduction, label_smoothing=label_smoothing)`` with ``logits = hidden @ weight.T + bias``,
    softcapped as ``softcap * tanh(logits / softcap)`` when ``softcap`` is given (Gemma 2) -- except
    that a ``"mean"`` over zero non-ignored targets is 0, not NaN. ``hidden`` may have leading dims
    (``(..., H)`` with ``target`` ``(...)``). Math is fp32; gradients come back in the inputs' dtypes.
    ``accum_dtype`` (default: the weight's dtype) is the dtype ``grad_weight`` / ``grad_bias`` are
    accumulated in across chunks; pass ``torch.float32`` for bf16 weights to trade 2 bytes per
    parameter (and some speed) for an exactly-rounded-once sum. Returns a 0-dim fp32 tensor.

    ``grad_weight_out`` (same shape as ``weight``, on its device): a buffer the weight's gradient is
    written into instead of a fresh ``(V, H)`` tensor -- e.g. a training engine's own gradient buffer,
    which saves a parameter-sized temporary and a copy. Its old contents are overwritten during this
    forward, and the backward returns it (scaled in place) as ``weight``'s gradient, so it must not be
    read or reused before that backward.

    ``row_weight`` (shaped like ``target``, float): each token's loss and gradient scaled by its weight
    (no gradient flows to the weights), as ``(F.cross_entropy(..., reduction="none") * row_weight)``
    summed, or divided by the count of non-ignored targets for ``"mean"``.
    """
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    target1d = target.reshape(-1)
    if target1d.numel() != hidden2d.shape[0]:
        raise ValueError(f"target {tuple(target.shape)} does not match hidden {tuple(hidden.shape)}")
    if grad_weight_out is not None and grad_weight_out.dtype != weight.dtype:
        # autograd would cast a gradient of another dtype, i.e. copy it out of the buffer again
        raise ValueError(f"grad_weight_out must have the weight's dtype {weight.dtype}, got {grad_weight_out.dtype}")
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    return LinearCrossEntropyFunction.apply(
        hidden2d, weight, target1d, bias, ignore_index, reduction, softcap, float(label_smoothing),
        accum_dtype, needs, grad_weight_out, None if row_weight is None else row_weight.reshape(-1),
    )  # fmt: skip
