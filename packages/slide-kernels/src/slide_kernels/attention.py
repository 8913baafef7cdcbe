"""Attention dispatch: flash-attn when it can run, else PyTorch SDPA, else an eager softcap path.

No Triton here: FlashAttention-2 and PyTorch's SDPA kernels already are the fast paths, so this module
only picks one and builds what the others lack (sliding-window / bottom-right causal masks for SDPA,
an eager path for logit softcapping, which SDPA cannot express).

Layout is HF's ``(B, H, S, D)`` for q, k and v; k and v may have fewer heads than q (GQA, ``Hq``
a multiple of ``Hk``). Conventions, the same on every backend:

* ``causal`` masks are aligned bottom-right when ``Sq != Sk`` (query ``i`` sits at absolute position
  ``Sk - Sq + i``), as in flash-attn and in decoding with a KV cache;
* ``sliding_window=W`` lets a query see the ``W`` most recent keys including itself
  (``0 <= i - j < W``; both sides ``|i - j| < W`` when not causal), HF's Mistral/Gemma-2 convention;
  flash-attn gets ``window_size=(W - 1, 0)``;
* ``softcap`` caps the scaled scores as ``softcap * tanh(s / softcap)`` before masking (Gemma 2);
* ``attn_mask`` is a boolean mask (``True`` = attend) or an additive float mask broadcastable to
  ``(B, H, Sq, Sk)``; it is combined with ``causal`` and ``sliding_window``.

A query row that can see no key at all gives NaN on the SDPA/eager paths (0 on flash-attn).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["AttentionBackend", "attention", "attention_backend"]

AttentionBackend = Literal["flash_attn", "sdpa", "eager"]


@functools.cache
def _flash_attn() -> tuple[Callable | None, bool]:
    """``(flash_attn_func, supports_softcap)``; imported lazily, once."""
    try:
        from flash_attn import flash_attn_func
    except Exception:  # not installed, or built against another torch/CUDA
        return None, False
    try:
        has_softcap = "softcap" in inspect.signature(flash_attn_func).parameters
    except (TypeError, ValueError):
        has_softcap = False
    return flash_attn_func, has_softcap


@functools.cache
def _sdpa_has_gqa() -> bool:
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


def _flash_ok(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    softcap: float | None,
) -> bool:
    fn, has_softcap = _flash_attn()
    if fn is None or attn_mask is not None or (softcap is not None and not has_softcap):
        return False
    if q is None or k is None or v is None:
        return torch.cuda.is_available()
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[-1] <= 256
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and q.shape[1] % k.shape[1] == 0
        and k.shape[1] == v.shape[1]
    )


def attention_backend(
    q: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    attn_mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> AttentionBackend:
    """Which implementation :func:`attention` would use: ``"flash_attn"``, ``"sdpa"`` or ``"eager"``.

    Why: for ``slide doctor`` and logs. With no tensors it answers for the common training case
    (bf16 on the current CUDA device, no mask, no softcap); pass the tensors and options to ask
    about a specific call.
    """
    if _flash_ok(q, k, v, attn_mask, softcap):
        return "flash_attn"
    return "eager" if softcap is not None else "sdpa"


def _keep_mask(
    s_q: int, s_k: int, causal: bool, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean ``(Sq, Sk)`` mask, ``True`` = attend; ``None`` when everything is visible."""
    if not causal and sliding_window is None:
        return None
    i = torch.arange(s_q, device=device).unsqueeze(1) + (s_k - s_q)
    j = torch.arange(s_k, device=device).unsqueeze(0)
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= i
    if sliding_window is not None:
        keep &= (i - j) < sliding_window
        if not causal:
            keep &= (j - i) < sliding_window
    return keep


def _combine(keep: torch.Tensor | None, attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if attn_mask is None:
        return keep
    if keep is None:
        return attn_mask
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.to(dtype).masked_fill(~keep, float("-inf"))


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    dropout_p: float,
) -> torch.Tensor:
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Scaled dot-product attention over ``(B, H, S, D)`` tensors with one fixed set of conventions.

    Why: model adapters should not care whether flash-attn is installed. This uses
    ``flash_attn.flash_attn_func`` for fp16/bf16 CUDA inputs without ``attn_mask`` (and with
    ``softcap`` only where the installed flash-attn has it), PyTorch SDPA otherwise, and an eager
    fp32-softmax path when ``softcap`` is set but flash-attn cannot take it. See the module docstring
    for the masking conventions. ``scale`` defaults to ``1/sqrt(D)``. ``dropout_p`` is applied as given
    (pass 0.0 in eval). Returns ``(B, Hq, Sq, D)``.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k and v must be (batch, heads, seq, head_dim)")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]}, {v.shape[1]})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)

    if _flash_ok(q, k, v, attn_mask, softcap):
        fn, _ = _flash_attn()
        kwargs: dict = {}
        if sliding_window is not None:
            kwargs["window_size"] = (sliding_window - 1, 0 if causal else sliding_window - 1)
        if softcap is not None:
            kwargs["softcap"] = float(softcap)
        out = fn(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            dropout_p=dropout_p, softmax_scale=scale, causal=causal, **kwargs,
        )  # fmt: skip
        return out.transpose(1, 2)

    s_q, s_k = q.shape[-2], k.shape[-2]
    simple_causal = causal and s_q == s_k and sliding_window is None and attn_mask is None
    keep = None if simple_causal else _keep_mask(s_q, s_k, causal, sliding_window, q.device)
    mask = _combine(keep, attn_mask, q.dtype)
    if softcap is not None:
        if simple_causal:
            mask = _keep_mask(s_q, s_k, True, None, q.device)
        return _eager(q, k, v, mask, scale, softcap, dropout_p)

    n_rep = q.shape[1] // k.shape[1]
    kwargs = {}
    if n_rep > 1:
        if _sdpa_has_gqa():
            kwargs["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=simple_causal, scale=scale, **kwargs
    )
