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

Note [Fused modules are checked, not named]: families spell the same class names for different math.
``Qwen3NextRMSNorm`` scales by ``1 + w`` (zero-centred weights) while ``Gemma4RMSNorm`` scales by ``w``;
OLMo-2 multiplies the weight before rounding to the input dtype, Llama after; GLM-4's
``apply_rotary_pos_emb`` rotates interleaved pairs, not halves. So nothing is rebound by its name alone:
before rebinding, the module's own code is run once on small CPU tensors (fp32 for the ``1 + w`` offset,
bf16 for the rounding order, full-width cos/sin for the rotary layout) and compared with what the kernel
computes; a module that matches neither form keeps HF's code. ``test_norm_forms_are_read_from_the_code``
checks the answers for every family.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from slide_kernels.ops.rms_norm import CastingMode

__all__ = [
    "GLU_ACTIVATIONS",
    "MLP_PROJECTIONS",
    "NormForm",
    "fuse_modules",
    "is_gated_mlp",
    "is_rms_norm",
    "norm_eps",
    "norm_form",
    "norm_reference",
    "rotates_halves",
    "runs_fused",
]

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The ``nn.Linear`` children of a dense gated MLP, in the order its forward uses them."""

GLU_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu"}
"""HF activation names whose ``act(gate) * up`` slide-kernels fuses (GeGLU is the tanh approximation)."""


def _runs_fused(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for ``x``: CUDA (or ROCm) tensors with Triton usable."""
    if x.device.type != "cuda":
        return False
    from slide_kernels._backend import use_triton

    return use_triton(x)


def runs_fused(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for ``x`` (what the rebound forwards here ask, for other modules that
    run the same kernels: slide_hf/adapters/tiled_mlp.py)."""
    return _runs_fused(x)


NormForm = tuple[float, "CastingMode"]
"""``(offset, casting_mode)`` of an RMSNorm, as slide-kernels' ``rms_norm`` takes them."""


def norm_eps(module: nn.Module) -> float:
    eps: Any = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps  # a float attribute
    return float(eps)


def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, form: NormForm) -> torch.Tensor:
    """What the kernel computes for ``form``, in plain torch (see slide_kernels/ops/rms_norm.py)."""
    offset, casting_mode = form
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "gemma":
        return (normed * (offset + weight.float())).to(x.dtype)
    return (offset + weight) * normed.to(x.dtype)


def norm_form(module: nn.Module) -> NormForm | None:
    """The ``(offset, casting_mode)`` that ``module``'s own forward computes, or None for neither form.

    Runs the module's code on the CPU (its meta weight replaced) -- see Note [Fused modules are checked,
    not named]. fp32 decides the offset (``w`` or ``1 + w``); bf16 decides the rounding order, which only
    shows there (Llama rounds the normalised input before the weight multiply, Gemma after).
    """
    from torch.func import functional_call

    width = cast(torch.Tensor, module.weight).shape[-1]
    eps = norm_eps(module)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(64, width, generator=g, device="cpu") * 3
    weight = torch.randn(width, generator=g, device="cpu") * 0.7

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return functional_call(module, {"weight": w}, (x,))

    try:
        fp32 = run(x, weight)
        offsets = [o for o in (0.0, 1.0) if torch.allclose(fp32, norm_reference(x, weight, eps, (o, "llama")))]
        if len(offsets) != 1:
            return None
        xb, wb = x.bfloat16(), weight.bfloat16()
        bf16 = run(xb, wb)
    except (RuntimeError, TypeError, ValueError):  # a norm with another signature or extra state
        return None
    casting_modes: tuple[CastingMode, ...] = ("llama", "gemma")
    modes = [m for m in casting_modes if torch.equal(bf16, norm_reference(xb, wb, eps, (offsets[0], m)))]
    return (offsets[0], modes[0]) if len(modes) == 1 else None


def _fused_rms_norm(module: nn.Module, form: NormForm) -> Callable[[torch.Tensor], torch.Tensor]:
    """The norm's ``forward``, with its parametrization (read from its code once) fixed here."""
    hf_forward = type(module).forward
    offset, casting_mode = form
    eps = norm_eps(module)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not _runs_fused(hidden_states):
            return hf_forward(module, hidden_states)
        from slide_kernels import rms_norm

        return rms_norm(hidden_states, cast(torch.Tensor, module.weight), eps, offset, casting_mode=casting_mode)

    return forward


def _fused_gated_mlp(module: nn.Module, glu: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's ``forward`` with ``act_fn(gate) * up`` as one slide-kernels op (``swiglu``/``geglu``)."""
    hf_forward = type(module).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _runs_fused(x):
            return hf_forward(module, x)
        import slide_kernels

        gate_proj, up_proj, down_proj = (cast(nn.Linear, getattr(module, n)) for n in MLP_PROJECTIONS)
        return down_proj(getattr(slide_kernels, glu)(gate_proj(x), up_proj(x)))

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


def rotates_halves(hf_rotary: Callable[..., Any]) -> bool:
    """Whether ``hf_rotary(q, k, cos, sin)`` is Llama's ``rotate_half`` RoPE, the layout the kernel computes,
    for full-width cos/sin (see Note [Fused modules are checked, not named]; GLM-4 pairs neighbours)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k = (torch.randn(1, 2, 3, 8, generator=g, device="cpu") for _ in range(2))
    cos, sin = (torch.randn(1, 3, 8, generator=g, device="cpu") for _ in range(2))

    def expected(x: torch.Tensor) -> torch.Tensor:
        half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
        return x * cos.unsqueeze(1) + half * sin.unsqueeze(1)

    try:
        with torch.no_grad():
            got_q, got_k = hf_rotary(q, k, cos, sin)[:2]
    except (RuntimeError, TypeError, ValueError, IndexError):
        return False
    return torch.allclose(got_q, expected(q)) and torch.allclose(got_k, expected(k))


def _rotary_forward(module: nn.Module) -> Callable[..., Any] | None:
    """A copy of the attention class's ``forward`` that sees the fused rotary, or None when the forward
    does not call a global ``apply_rotary_pos_emb`` (e.g. it is wrapped by a decorator) or that function
    is not the ``rotate_half`` layout."""
    forward = type(module).forward
    hf_rotary = getattr(forward, "__globals__", {}).get("apply_rotary_pos_emb")
    if hf_rotary is None or "apply_rotary_pos_emb" not in forward.__code__.co_names:
        return None
    if not rotates_halves(hf_rotary):
        return None
    scope = {**forward.__globals__, "apply_rotary_pos_emb": _fused_rotary(hf_rotary)}
    copy = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__)
    copy.__kwdefaults__ = forward.__kwdefaults__
    copy.__qualname__ = forward.__qualname__
    return copy


def is_rms_norm(module: nn.Module) -> bool:
    has_eps = hasattr(module, "variance_epsilon") or hasattr(module, "eps")
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), nn.Parameter)
        and has_eps
    )


def is_gated_mlp(module: nn.Module, activation: str) -> bool:
    """HF's dense ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with the config's activation."""
    from transformers.activations import ACT2FN

    if activation not in ACT2FN:
        return False
    projections = all(isinstance(getattr(module, n, None), nn.Linear) for n in MLP_PROJECTIONS)
    act = getattr(module, "act_fn", None)
    return projections and type(module).__name__.endswith("MLP") and type(act) is type(ACT2FN[activation])


def fuse_modules(root: nn.Module, config: Any, forms: dict[type, NormForm | None] | None = None) -> list[str]:
    """Rebind the RMSNorms and dense gated MLPs under ``root`` to slide-kernels' fused ops (see the module
    docstring); return the names of the rebound submodules. Nothing is rebound without slide-kernels.

    ``forms`` holds the norm forms already read, by class: a model passes one dict for all of its blocks,
    so each norm class's code is run once per model, not once per block (the form is the class's code,
    the same in every block; a released model's 40-odd blocks would otherwise each rerun the check)."""
    try:
        import slide_kernels  # noqa: F401
    except ImportError:
        return []
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    glu = GLU_ACTIVATIONS.get(str(activation))
    rebound = []
    forms = {} if forms is None else forms  # one check per norm class
    for name, module in root.named_modules():
        if is_rms_norm(module):
            if type(module) not in forms:
                forms[type(module)] = norm_form(module)
            form = forms[type(module)]
            if form is not None:
                module.forward = _fused_rms_norm(module, form)
                rebound.append(name)
        elif glu is not None and is_gated_mlp(module, str(activation)):
            module.forward = _fused_gated_mlp(module, glu)
            rebound.append(name)
        elif type(module).__name__.endswith("Attention") and (forward := _rotary_forward(module)) is not None:
            module.forward = types.MethodType(forward, module)
            rebound.append(name)
    return rebound
