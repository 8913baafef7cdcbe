"""Gated MLP activations: SwiGLU (Llama, Mistral, Qwen) and GeGLU with tanh-GELU (Gemma).

Eager PyTorch runs ``act(gate) * up`` as two or three kernels forward and about five backward, each a
full pass over ``(tokens, intermediate)`` tensors. Here the forward is one pass (read gate and up,
write the product) and the backward is one pass that recomputes the activation from the saved inputs
(read dout, gate, up; write dgate, dup), so nothing but the inputs is kept for backward. Math is fp32
in registers whatever the storage dtype.
"""

from __future__ import annotations

import torch

from slide_kernels._backend import tl, triton, use_triton

__all__ = ["geglu", "geglu_backward", "geglu_forward", "swiglu", "swiglu_backward", "swiglu_forward"]

_BLOCK = 1024  # elements per program: 4 warps x 32 lanes x 8 elements (16-byte bf16 vectors)
_GELU_C = 0.7978845608028654  # sqrt(2 / pi)
_GELU_A = 0.044715


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _gelu_tanh_parts(a):
    """``(1 + tanh(u), 1 - tanh(u))`` for the GELU inner ``u``, without cancellation.

    With ``e = exp(-2|u|)``: ``1 + tanh(u)`` is ``2 / (1 + e)`` for ``u >= 0`` and ``2e / (1 + e)``
    otherwise (and the reverse for ``1 - tanh(u)``), so the tails of GELU and of its derivative keep
    full fp32 relative precision instead of rounding ``1 - 0.9999999`` to zero.
    """
    u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
    e = tl.exp(-2.0 * tl.abs(u))
    big = 2.0 / (1.0 + e)
    small = big * e
    one_plus = tl.where(u >= 0, big, small)
    one_minus = tl.where(u >= 0, small, big)
    return one_plus, one_minus


@triton.jit
def _glu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n_elements, ACT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    a = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # silu
        act = a * tl.sigmoid(a)
    else:  # gelu, tanh approximation
        one_plus, _ = _gelu_tanh_parts(a)
        act = 0.5 * a * one_plus
    tl.store(out_ptr + offs, (act * b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n_elements, ACT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dc = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        sig = tl.sigmoid(a)
        act = a * sig
        dact = sig * (1.0 + a * (1.0 - sig))
    else:
        one_plus, one_minus = _gelu_tanh_parts(a)
        act = 0.5 * a * one_plus
        dinner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * a * a)
        dact = 0.5 * one_plus + 0.5 * a * one_plus * one_minus * dinner
    tl.store(dgate_ptr + offs, (dc * b * dact).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, (dc * act).to(dup_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# torch fallback (same math, fp32)
# ----------------------------------------------------------------------------------------------
def _act_and_grad_torch(a: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    if act == 0:
        sig = torch.sigmoid(a)
        return a * sig, sig * (1.0 + a * (1.0 - sig))
    u = _GELU_C * (a + _GELU_A * a.pow(3))
    e = torch.exp(-2.0 * u.abs())
    big = 2.0 / (1.0 + e)
    small = big * e
    one_plus, one_minus = torch.where(u >= 0, big, small), torch.where(u >= 0, small, big)
    dinner = _GELU_C * (1.0 + 3.0 * _GELU_A * a * a)
    return 0.5 * a * one_plus, 0.5 * one_plus + 0.5 * a * one_plus * one_minus * dinner


# ----------------------------------------------------------------------------------------------
# launchers (no autograd)
# ----------------------------------------------------------------------------------------------
def _check(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate and up must have the same dtype, got {gate.dtype} and {up.dtype}")
    return gate.contiguous(), up.contiguous()


def _glu_forward(gate: torch.Tensor, up: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gate, up = _check(gate, up)
    if use_triton(gate):
        out = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _glu_fwd_kernel[(triton.cdiv(n, _BLOCK),)](gate, up, out, n, ACT=act, BLOCK=_BLOCK)
    else:
        value, _ = _act_and_grad_torch(gate.float(), act)
        out = (value * up.float()).to(gate.dtype)
    return out, gate, up


def _glu_backward(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int
) -> tuple[torch.Tensor, torch.Tensor]:
    dout = dout.contiguous()
    if use_triton(gate):
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _glu_bwd_kernel[(triton.cdiv(n, _BLOCK),)](dout, gate, up, dgate, dup, n, ACT=act, BLOCK=_BLOCK)
        return dgate, dup
    a, b, dc = gate.float(), up.float(), dout.float()
    value, dvalue = _act_and_grad_torch(a, act)
    return (dc * b * dvalue).to(gate.dtype), (dc * value).to(up.dtype)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``silu(gate) * up`` without autograd; returns ``(out, gate, up)``, the last two kept for backward."""
    return _glu_forward(gate, up, 0)


def swiglu_backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(d_gate, d_up)`` of :func:`swiglu`, recomputing ``silu(gate)`` on the fly."""
    return _glu_backward(dout, gate, up, 0)


def geglu_forward(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gelu_tanh(gate) * up`` without autograd; returns ``(out, gate, up)``."""
    return _glu_forward(gate, up, 1)


def geglu_backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(d_gate, d_up)`` of :func:`geglu`, recomputing ``gelu_tanh(gate)`` on the fly."""
    return _glu_backward(dout, gate, up, 1)


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------
class SwiGLUFunction(torch.autograd.Function):
    """Autograd glue for :func:`swiglu`: keeps gate and up, recomputes the activation in backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out, gate, up = swiglu_forward(gate, up)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return swiglu_backward(dout, gate, up)


class GeGLUFunction(torch.autograd.Function):
    """Autograd glue for :func:`geglu`."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out, gate, up = geglu_forward(gate, up)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return geglu_backward(dout, gate, up)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the Llama/Mistral/Qwen MLP gate, in one fused pass each way.

    Why: eager PyTorch materializes ``silu(gate)`` and its backward intermediates; fusing cuts the
    memory traffic of the MLP activation roughly 2-3x and keeps only ``gate`` and ``up`` for backward.
    ``gate`` and ``up`` must have the same shape and dtype; any shape works (it is elementwise).
    """
    return SwiGLUFunction.apply(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up``, Gemma's MLP gate (HF ``gelu_pytorch_tanh``), fused like :func:`swiglu`.

    Why: same as :func:`swiglu`; uses the tanh approximation of GELU, which is what Gemma checkpoints
    were trained with (``F.gelu(x, approximate="tanh")``).
    """
    return GeGLUFunction.apply(gate, up)
