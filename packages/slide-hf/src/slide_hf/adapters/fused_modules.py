"""slide-kernels' fused RMSNorm and gated-MLP activation inside HF's own modules.

The adapters run HF's decoder layers as they are (``functional_call``), so a Llama layer's two RMSNorms
and its ``act_fn(gate) * up`` are eager PyTorch: several full passes over the activations each way, every
one of them three times per step in the engine (forward, recompute, backward). :func:`fuse_modules`
rebinds the ``forward`` of those submodules, per instance, to one Triton kernel each way. The HF math is
kept: the norm's rounding follows the module's family (``casting_mode``), and the activation is the one
the config names.

Rotary embeddings: HF's attention ``forward`` calls its modeling module's global
``apply_rotary_pos_emb``. Replacing that global would change every model in the process, so each
attention module instead gets its own copy of its class's ``forward`` whose globals map that one name to
slide-kernels' ``apply_rotary`` (partial rotary, as in some Phi-3 configs, keeps HF's function).

A rebound module runs the kernel only on CUDA tensors with Triton available (``_runs_fused``), and its
class's own code otherwise, so CPU runs, and the exactness tests against HF, are unchanged.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["fuse_modules"]

_GLU_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu"}
"""HF activation names whose ``act(gate) * up`` slide-kernels fuses (GeGLU is the tanh approximation)."""


def _runs_fused(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for ``x``: CUDA (or ROCm) tensors with Triton usable."""
    if x.device.type != "cuda":
        return False
    from slide_kernels._backend import use_triton

    return use_triton(x)


def _fused_rms_norm(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The norm's ``forward``, with its family's parametrization read once here, not per call."""
    hf_forward = type(module).forward
    gemma = type(module).__name__.startswith("Gemma")  # ``(1 + w) * x``, rounded as HF's Gemma norms
    offset, casting_mode = (1.0, "gemma") if gemma else (0.0, "llama")
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not _runs_fused(hidden_states):
            return hf_forward(module, hidden_states)
        from slide_kernels import rms_norm

        return rms_norm(hidden_states, module.weight, eps, offset, casting_mode=casting_mode)

    return forward


def _fused_gated_mlp(module: nn.Module, glu: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's ``forward`` with ``act_fn(gate) * up`` as one slide-kernels op (``swiglu``/``geglu``)."""
    hf_forward = type(module).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _runs_fused(x):
            return hf_forward(module, x)
        import slide_kernels

        return module.down_proj(getattr(slide_kernels, glu)(module.gate_proj(x), module.up_proj(x)))

    return forward


def _fused_rotary(hf_rotary: Callable[..., Any]) -> Callable[..., Any]:
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``, fused where the kernel applies."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        full = not args and not kwargs and cos.dim() == 3 and cos.shape[-1] == q.shape[-1]
        if full and _runs_fused(q):
            from slide_kernels import apply_rotary

            return apply_rotary(q, k, cos, sin)
        return hf_rotary(q, k, cos, sin, *args, **kwargs)

    return apply_rotary_pos_emb


def _rotary_forward(module: nn.Module) -> Callable[..., Any] | None:
    """A copy of the attention class's ``forward`` that sees the fused rotary, or None when the forward
    does not call a global ``apply_rotary_pos_emb`` (e.g. it is wrapped by a decorator)."""
    forward = type(module).forward
    hf_rotary = getattr(forward, "__globals__", {}).get("apply_rotary_pos_emb")
    if hf_rotary is None or "apply_rotary_pos_emb" not in forward.__code__.co_names:
        return None
    scope = {**forward.__globals__, "apply_rotary_pos_emb": _fused_rotary(hf_rotary)}
    copy = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__)
    copy.__kwdefaults__ = forward.__kwdefaults__
    copy.__qualname__ = forward.__qualname__
    return copy


def _is_rms_norm(module: nn.Module) -> bool:
    has_eps = hasattr(module, "variance_epsilon") or hasattr(module, "eps")
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), nn.Parameter)
        and has_eps
    )


def _is_gated_mlp(module: nn.Module, activation: str) -> bool:
    """HF's dense ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with the config's activation."""
    from transformers.activations import ACT2FN

    projections = all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
    act = getattr(module, "act_fn", None)
    return projections and type(module).__name__.endswith("MLP") and type(act) is type(ACT2FN[activation])


def fuse_modules(root: nn.Module, config: Any) -> list[str]:
    """Rebind the RMSNorms and dense gated MLPs under ``root`` to slide-kernels' fused ops (see the module
    docstring); return the names of the rebound submodules. Nothing is rebound without slide-kernels."""
    try:
        import slide_kernels  # noqa: F401
    except ImportError:
        return []
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    glu = _GLU_ACTIVATIONS.get(str(activation))
    rebound = []
    for name, module in root.named_modules():
        if _is_rms_norm(module):
            module.forward = _fused_rms_norm(module)
            rebound.append(name)
        elif glu is not None and _is_gated_mlp(module, str(activation)):
            module.forward = _fused_gated_mlp(module, glu)
            rebound.append(name)
        elif type(module).__name__.endswith("Attention") and (forward := _rotary_forward(module)) is not None:
            module.forward = types.MethodType(forward, module)
            rebound.append(name)
    return rebound
