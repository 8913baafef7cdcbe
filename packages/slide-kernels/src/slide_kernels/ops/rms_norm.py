"""RMSNorm, fused forward and backward.

``y = x / sqrt(mean(x**2) + eps) * (offset + weight)`` over the last dimension, statistics in fp32.

Two casting modes, because the HF model families differ in where they round:

* ``"llama"`` (default when ``offset == 0``) matches ``transformers``' ``LlamaRMSNorm`` (also Mistral,
  Qwen2, Phi3, ...): normalize in fp32, cast the normalized value to ``x.dtype``, then multiply by
  ``weight`` (``self.weight * hidden_states.to(input_dtype)``).
* ``"gemma"`` (default when ``offset != 0``) matches ``GemmaRMSNorm`` / ``Gemma2RMSNorm``
  (``offset=1.0``): normalize and multiply by ``(offset + weight.float())`` all in fp32, cast once.

The output is always ``x.dtype`` (HF's Llama module returns ``weight.dtype`` promoted with the input,
which is the same thing whenever the weight has the activation dtype, as in bf16 training).

The forward is one pass per row (read x, write y and the fp32 ``rstd`` per row). The backward is one
pass that recomputes ``x_hat`` from ``x`` and ``rstd`` and writes ``dx``; ``dweight`` is reduced per
program into an fp32 ``(programs, H)`` buffer in registers and summed once at the end, so there are
no atomics and the result is deterministic.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from slide_kernels._backend import num_warps_for, tl, triton, use_triton

__all__ = ["rms_norm", "rms_norm_backward", "rms_norm_forward"]

CastingMode = Literal["llama", "gemma"]
_MAX_BLOCK = 65536  # widest row a single program holds in registers; wider rows use the fallback


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    x_row_stride,
    y_row_stride,
    n_cols,
    eps,
    offset,
    GEMMA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    x_hat = xf * rstd
    if GEMMA:  # noqa: SIM108
        y = x_hat * (offset + w)
    else:
        # round like HF Llama: normalized value in the input dtype, then times the weight
        y = x_hat.to(x.dtype).to(tl.float32) * (offset + w)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_ptr,
    dy_row_stride,
    x_row_stride,
    dx_row_stride,
    n_rows,
    n_cols,
    rows_per_program,
    offset,
    GEMMA: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    first = row_start.to(tl.int64)
    dy_row = dy_ptr + first * dy_row_stride
    x_row = x_ptr + first * x_row_stride
    dx_row = dx_ptr + first * dx_row_stride
    rstd_row = rstd_ptr + first
    for _ in range(row_start, row_end):
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        rstd = tl.load(rstd_row)
        x_hat = x.to(tl.float32) * rstd
        g = dy * w
        # d/dx [x * rstd(x)] applied to g:  rstd * (g - x_hat * mean(g * x_hat))
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if GEMMA:
                dw_acc += dy * x_hat
            else:
                dw_acc += dy * x_hat.to(x.dtype).to(tl.float32)
        dy_row += dy_row_stride
        x_row += x_row_stride
        dx_row += dx_row_stride
        rstd_row += 1
    if COMPUTE_DW:
        tl.store(dw_ptr + pid * n_cols + cols, dw_acc, mask=mask)


# ----------------------------------------------------------------------------------------------
# launchers (no autograd)
# ----------------------------------------------------------------------------------------------
def _resolve_mode(offset: float, casting_mode: CastingMode | None) -> bool:
    mode = casting_mode if casting_mode is not None else ("gemma" if offset != 0.0 else "llama")
    if mode not in ("llama", "gemma"):
        raise ValueError(f"casting_mode must be 'llama' or 'gemma', got {mode!r}")
    return mode == "gemma"


def _num_programs(device: torch.device, n_rows: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_rows, sms * 16))  # enough rows in flight to hide each row's reduction
    return max(1, min(n_rows, 8))


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalize ``x`` (any leading dims) without autograd.

    Returns ``(y, x2d, rstd)``: the output shaped like ``x``, the 2-D view of ``x`` that backward reads,
    and the fp32 per-row ``1/sqrt(mean(x^2)+eps)``.
    """
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"weight must have shape ({n_cols},), got {tuple(weight.shape)}")
    x2d = x.reshape(-1, n_cols)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    n_rows = x2d.shape[0]
    block = triton.next_power_of_2(n_cols)
    if use_triton(x) and block <= _MAX_BLOCK:
        weight = weight.contiguous()
        y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        if n_rows:
            _rms_norm_fwd_kernel[(n_rows,)](
                x2d, weight, y, rstd, x2d.stride(0), y.stride(0), n_cols, eps, offset,
                GEMMA=gemma, BLOCK=block, num_warps=num_warps_for(block),
            )  # fmt: skip
    else:
        xf = x2d.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
        x_hat = xf * rstd[:, None]
        if not gemma:
            x_hat = x_hat.to(x.dtype).float()
        y = (x_hat * (offset + weight.float())).to(x.dtype)
    return y.view(x.shape), x2d, rstd


def rms_norm_backward(
    dy: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    gemma: bool,
    compute_dweight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients ``(dx, dweight)`` of :func:`rms_norm` from the values :func:`rms_norm_forward` returned.

    ``dx`` has the shape of ``dy``; ``dweight`` is ``None`` unless ``compute_dweight``.
    """
    n_rows, n_cols = x2d.shape
    dy2d = dy.reshape(-1, n_cols)
    if dy2d.stride(-1) != 1:
        dy2d = dy2d.contiguous()
    block = triton.next_power_of_2(n_cols)
    if use_triton(x2d) and block <= _MAX_BLOCK:
        weight = weight.contiguous()
        dx = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
        programs = _num_programs(x2d.device, n_rows)
        rows_per_program = math.ceil(n_rows / programs) if n_rows else 0
        dw_partial = torch.empty(
            (programs, n_cols) if compute_dweight else (1,), dtype=torch.float32, device=x2d.device
        )
        if n_rows:
            _rms_norm_bwd_kernel[(programs,)](
                dy2d, x2d, weight, rstd, dx, dw_partial,
                dy2d.stride(0), x2d.stride(0), dx.stride(0),
                n_rows, n_cols, rows_per_program, offset,
                GEMMA=gemma, COMPUTE_DW=compute_dweight, BLOCK=block, num_warps=num_warps_for(block),
            )  # fmt: skip
        dweight = None
        if compute_dweight:
            dweight = dw_partial.sum(0).to(weight.dtype) if n_rows else torch.zeros_like(weight)
        return dx.view(dy.shape), dweight
    xf, dyf = x2d.float(), dy2d.float()
    x_hat = xf * rstd[:, None]
    g = dyf * (offset + weight.float())
    dx = rstd[:, None] * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    dweight = None
    if compute_dweight:
        x_hat_w = x_hat if gemma else x_hat.to(x2d.dtype).float()
        dweight = (dyf * x_hat_w).sum(0).to(weight.dtype)
    return dx.to(x2d.dtype).view(dy.shape), dweight


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------
class RMSNormFunction(torch.autograd.Function):
    """Autograd glue for :func:`rms_norm`: keeps x (2-D view), weight and the fp32 rstd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool) -> torch.Tensor:
        y, x2d, rstd = rms_norm_forward(x, weight, eps, offset, gemma)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.offset, ctx.gemma = offset, gemma
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2d, weight, rstd = ctx.saved_tensors
        dx, dweight = rms_norm_backward(
            dy, x2d, weight, rstd, ctx.offset, ctx.gemma, compute_dweight=ctx.needs_input_grad[1]
        )
        return dx, dweight, None, None, None


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    *,
    casting_mode: CastingMode | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * (offset + weight)``.

    Why: eager RMSNorm is ~6 kernels forward and more backward, each a full pass over the
    activations; this is one pass each way, with statistics in fp32 and the output in ``x.dtype``.
    ``offset=1.0`` gives Gemma's ``(1 + weight)`` parametrization. ``casting_mode`` defaults to
    ``"llama"`` (HF ``LlamaRMSNorm`` rounding) when ``offset == 0`` and to ``"gemma"`` (HF
    ``GemmaRMSNorm`` rounding) otherwise; both are identical for fp32 inputs. Any number of leading
    dims and any hidden size (odd ones too) work.
    """
    return RMSNormFunction.apply(x, weight, float(eps), float(offset), _resolve_mode(offset, casting_mode))
