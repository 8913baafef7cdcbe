"""Which gated-delta-rule implementation the linear-attention layers run (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

Why a rule of our own instead of transformers': transformers 5 resolves ``torch_chunk_gated_delta_rule``
once, when its modeling module is imported, to flash-linear-attention's (fla's) kernel if ``fla`` imports
and to its own torch function otherwise, for every device and every process alike. That is wrong three
ways for training:

- fla 0.6.0 refuses its backward on Hopper GPUs with Triton >= 3.4 and < 3.7.1 (those Triton releases
  compile one of its backward kernels into one that gives incorrect results), so a run on an H100/H200
  with torch 2.11's Triton 3.6 fails at its first backward;
- the planner runs blocks on the ``meta`` device to measure what they save (planner/activations.py), and a
  Triton kernel launched on meta tensors reads address 0: an illegal memory access that poisons the CUDA
  context of the whole process;
- the CPU device has no fla kernels at all.

So each model with delta-net layers owns a :class:`LinearAttention` that re-binds every delta-net layer's
forward (HF's own code, unchanged) to resolve the kernel names to functions of its choosing, and picks one
path per (device, compute dtype), once, on first use:

1. ``SLIDE_LINEAR_ATTENTION=torch``: transformers' torch path.
2. Not a CUDA device (the CPU, and the planner's meta device): the torch path.
3. fla not importable, or older than :data:`FLA_MIN_VERSION`: the torch path.
4. A Hopper GPU with Triton in ``[3.4.0, 3.7.1)`` and no tilelang (fla's own guard; with tilelang installed
   fla routes the affected kernel through it): the torch path.
5. fla's kernel is run forward and backward on a tiny input on the run's device and dtype and compared with
   transformers' torch function (relative error, :data:`CHECK_TOLERANCE`); any difference beyond it, or an
   error other than a CUDA fault, and the torch path runs.
6. Otherwise fla's ``chunk_gated_delta_rule``.

``SLIDE_LINEAR_ATTENTION=fla`` runs the same checks but makes a failing one an error (one line), for runs
that must not fall back silently; ``auto`` (the default) falls back. The choice is logged in one line per
device. Only the chunked delta rule changes with the path: the causal convolution runs transformers'
``F.conv1d`` code in both (the optional ``causal_conv1d`` package is never picked up behind our back), and
the one-token recurrent rule is used only with a cache, which training never has.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slide_hf.errors import UserError

__all__ = [
    "AUTO",
    "CHECK_TOLERANCE",
    "ENV_VAR",
    "FLA",
    "FLA_MIN_VERSION",
    "TORCH",
    "FlaFacts",
    "LinearAttention",
    "LinearAttentionPath",
    "check_against_torch",
    "choose_linear_attention",
    "fla_refusal",
    "requested_linear_attention",
]

log = logging.getLogger(__name__)

AUTO, TORCH, FLA = "auto", "torch", "fla"
ENV_VAR = "SLIDE_LINEAR_ATTENTION"
"""``auto`` (default), ``torch`` or ``fla``; read once when a model is built."""

FLA_MIN_VERSION = "0.6.0"
"""The first flash-linear-attention release that guards its Hopper backward (older ones compute it wrong
under Triton 3.4-3.7.0 without a word); ``slide-hf[fla]`` pins it."""

HOPPER_BAD_TRITON = ("3.4.0", "3.7.1")
"""Triton releases ``[first, fixed)`` whose compile of fla's gated ``chunk_bwd_dqkwg`` is wrong on Hopper."""

CHECK_TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 2e-2, torch.float16: 2e-2}
"""Largest relative error (``|a - b| / |b|``, Frobenius) of fla's output and input gradients against
transformers' torch function in fp32. fla multiplies in the compute dtype (TF32 for fp32), so a correct
kernel lands near the dtype's rounding; the Hopper miscompile is off by far more."""

_KERNEL_NAMES = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
"""The module-level names transformers' delta-net forwards call; each is re-bound per layer."""

_CHUNK = "torch_chunk_gated_delta_rule"

ChunkRule = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def requested_linear_attention(environ: Mapping[str, str] | None = None) -> str:
    """The user's ``SLIDE_LINEAR_ATTENTION`` (``auto`` when unset); a bad value is one line naming it."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, AUTO).strip().lower() or AUTO
    if value not in (AUTO, TORCH, FLA):
        raise UserError(f"{ENV_VAR}={value!r} is not one of {AUTO}, {TORCH}, {FLA}")
    return value


@dataclass(frozen=True)
class LinearAttentionPath:
    """The delta-rule implementation one (device, dtype) runs, and why."""

    name: str
    """``"fla"`` or ``"torch"``."""
    reason: str
    chunk: ChunkRule = dataclasses.field(repr=False, compare=False)
    """Called as transformers calls ``torch_chunk_gated_delta_rule``."""

    def describe(self) -> str:
        """``"torch path (flash-linear-attention is not installed)"`` -- for logs and ``slide doctor``."""
        label = "flash-linear-attention" if self.name == FLA else "torch path"
        return f"{label} ({self.reason})"


@dataclass(frozen=True)
class FlaFacts:
    """What decides whether fla may run on one device, before any kernel runs."""

    version: str | None
    """fla's version; None where it does not import."""
    problem: str | None = None
    """Why it does not import (None: not installed at all, or it imports)."""
    triton: str | None = None
    capability: tuple[int, int] | None = None
    """The CUDA device's compute capability; None on ROCm."""
    tilelang: bool = False

    @classmethod
    def detect(cls, device: torch.device) -> FlaFacts:
        """Import fla (which imports triton) and read the versions and the GPU's architecture."""
        try:
            fla = _import_fla()
        except ModuleNotFoundError as error:
            if error.name is not None and error.name.split(".")[0] == "fla":
                return cls(None)
            return cls(None, problem=_one_line(error))
        except Exception as error:  # a broken build: undefined symbols, a Triton it cannot use
            return cls(None, problem=_one_line(error))
        triton = _version_of("triton")
        capability = None
        if not torch.version.hip:
            major, minor = torch.cuda.get_device_capability(device)
            capability = (major, minor)
        tilelang = importlib.util.find_spec("tilelang") is not None
        return cls(str(getattr(fla, "__version__", "0")), triton=triton, capability=capability, tilelang=tilelang)


def _import_fla() -> types.ModuleType:
    """fla's package (its kernel is imported by :func:`_load_fla_chunk`); a seam tests replace."""
    return importlib.import_module("fla")


def _load_fla_chunk() -> ChunkRule:
    """fla's chunked gated delta rule, called the way transformers calls its torch function."""
    fla_chunk = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule

    def fla_chunk_gated_delta_rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return fla_chunk(
            q=query, k=key, v=value, g=g, beta=beta, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens,
        )  # fmt: skip

    return fla_chunk_gated_delta_rule


def fla_refusal(facts: FlaFacts) -> str | None:
    """Why fla must not run given ``facts``, as the reason of the torch path; None where nothing refuses."""
    from packaging.version import Version

    if facts.version is None:
        if facts.problem is None:
            return "flash-linear-attention is not installed"
        return f"flash-linear-attention does not import: {facts.problem}"
    if _parsed(facts.version) < Version(FLA_MIN_VERSION):
        return f"flash-linear-attention {facts.version} is older than {FLA_MIN_VERSION}"
    first, fixed = HOPPER_BAD_TRITON
    hopper = facts.capability is not None and facts.capability[0] == 9
    triton = _parsed(facts.triton) if facts.triton else None
    if hopper and triton is not None and Version(first) <= triton < Version(fixed) and not facts.tilelang:
        return (
            f"flash-linear-attention {facts.version} refuses its backward on Hopper with Triton {facts.triton} "
            f"< {fixed}"
        )
    return None


def check_against_torch(
    candidate: ChunkRule, reference: ChunkRule, device: torch.device, dtype: torch.dtype
) -> str | None:
    """Run ``candidate`` forward and backward on a tiny input on ``device`` in ``dtype``, as transformers'
    delta-net layers call it, against ``reference`` (transformers' torch function) in fp32; the reason it
    must not be used, or None when its output and every input gradient agree (:data:`CHECK_TOLERANCE`).

    A CUDA fault is raised, not returned: it leaves the process's CUDA context unusable, so nothing could
    run after it (``slide``'s error line names the package it came from). This is a CPU-GPU sync point.
    """
    generator = torch.Generator(device=device).manual_seed(0)
    batch, seq, heads, head_dim = 1, 100, 2, 128  # 100: a partial last chunk of 64, as real lengths often have

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)

    base = {
        "query": draw(batch, seq, heads, head_dim),
        "key": draw(batch, seq, heads, head_dim),
        "value": draw(batch, seq, heads, head_dim),
        "g": F.logsigmoid(draw(batch, seq, heads)),  # log decays <= 0, fp32 as the layers compute them
        "beta": draw(batch, seq, heads).sigmoid(),
    }
    grad_out = draw(batch, seq, heads, head_dim)
    results = []
    for rule, cast in ((reference, torch.float32), (candidate, dtype)):
        leaves = {k: v.to(torch.float32 if k == "g" else cast, copy=True).requires_grad_() for k, v in base.items()}
        try:
            with torch.enable_grad():
                out, _ = rule(**leaves, use_qk_l2norm_in_kernel=True)
                out.float().backward(grad_out)
        except Exception as error:
            if rule is reference or _is_cuda_fault(error):
                raise
            return f"its kernel failed a check on {device} in {_dtype_name(dtype)}: {_one_line(error)}"
        results.append([out.detach(), *(leaf.grad for leaf in leaves.values())])
    tolerance = CHECK_TOLERANCE[dtype]
    names = ("output", *(f"gradient of {k}" for k in base))
    for name, ref, got in zip(names, *results, strict=True):
        if got is None:
            return f"its kernel gives no {name} on {device}"
        difference = float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
        if not difference <= tolerance:  # also NaN
            return (
                f"its kernel's {name} differs from transformers' torch path by {difference:.3g} (relative) on {device} "
                f"in {_dtype_name(dtype)}, more than {tolerance:g}"
            )
    return None


def choose_linear_attention(
    request: str,
    device: torch.device,
    dtype: torch.dtype,
    reference: ChunkRule,
    *,
    facts: FlaFacts | None = None,
) -> LinearAttentionPath:
    """The path for ``device`` and ``dtype`` under ``request`` (see the module docstring for the rule);
    ``reference`` is transformers' torch function, also what fla is checked against. ``facts``: for tests,
    else detected. Raises :class:`UserError` where ``request`` is ``fla`` and fla cannot run."""

    def torch_path(reason: str) -> LinearAttentionPath:
        return LinearAttentionPath(TORCH, reason, reference)

    if request == TORCH:
        return torch_path(f"{ENV_VAR}={TORCH}")
    if device.type != "cuda":
        why = f"flash-linear-attention's kernels run on CUDA only, not on the {device.type} device"
        if request == FLA and device.type != "meta":
            raise UserError(f"{ENV_VAR}={FLA}, but {why}; unset it there")
        return torch_path(why)
    facts = FlaFacts.detect(device) if facts is None else facts
    refusal = fla_refusal(facts)
    if refusal is None:
        chunk = _load_fla_chunk()
        refusal = check_against_torch(chunk, reference, device, dtype)
        if refusal is not None:
            refusal = f"flash-linear-attention {facts.version}: {refusal}"
    if refusal is not None:
        if request == FLA:
            raise UserError(f"{ENV_VAR}={FLA}, but {refusal}; unset it to run transformers' torch path")
        return torch_path(refusal)
    triton = f", Triton {facts.triton}" if facts.triton else ""
    reason = f"{facts.version}{triton}, matched transformers' torch path on {device} in {_dtype_name(dtype)}"
    return LinearAttentionPath(FLA, reason, chunk)


class LinearAttention:
    """One model's choice of delta-rule implementation per (device, dtype), and the layers bound to it.

    Built by the model (:meth:`for_layers`) over its blocks' HF modules: every module whose forward calls
    ``torch_chunk_gated_delta_rule`` (transformers' ``Qwen3NextGatedDeltaNet`` and its Qwen3.5 copies) gets
    an instance-level forward -- the class's own code, its global names resolved in a copy of its module's
    namespace where the kernel names are this object's functions -- so the layer runs what was chosen here
    for the device its inputs are on, whatever transformers resolved at import. The choice is cached on this
    object, not per process: two models in one process decide independently, and one model may run on the
    meta device (planning), the CPU and a GPU.
    """

    def __init__(self, reference: ChunkRule, torch_kernels: Mapping[str, Callable[..., Any]], request: str) -> None:
        self.request = request
        self._reference = reference
        self._torch_kernels = dict(torch_kernels)
        self._paths: dict[tuple[str, int | None, torch.dtype], LinearAttentionPath] = {}

    @classmethod
    def for_layers(cls, roots: Iterable[nn.Module], request: str | None = None) -> LinearAttention | None:
        """Bind every delta-net module under ``roots``; None where there is none."""
        layers = [m for root in roots for m in root.modules() if _CHUNK in _forward_names(type(m))]
        if not layers:
            return None
        owner = cls.for_class(type(layers[0]), request)
        namespaces: dict[type, dict[str, Any]] = {}
        for layer in layers:
            owner._bind(layer, namespaces)
        return owner

    @classmethod
    def for_class(cls, layer_class: type[nn.Module], request: str | None = None) -> LinearAttention:
        """A choice over the torch functions of ``layer_class``'s transformers module, binding no layer
        (``slide doctor`` asks what would run without building a model)."""
        kernels = _torch_kernels(layer_class)
        return cls(kernels[_CHUNK], kernels, requested_linear_attention() if request is None else request)

    def path_for(self, device: torch.device, dtype: torch.dtype) -> LinearAttentionPath:
        """The path ``device`` runs at ``dtype``: decided on first use (logged once, but for the meta device).
        The run's setup asks first (so the line comes with the run's other setup lines and the GPU check
        runs before the engine does); the layers ask again for the device their inputs are on."""
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one decision
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device.type, device.index, dtype)
        found = self._paths.get(key)
        if found is None:
            found = choose_linear_attention(self.request, device, dtype, self._reference)
            self._paths[key] = found
            if device.type != "meta":
                log.info("linear attention: %s", found.describe())
        return found

    def chunk_gated_delta_rule(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **options: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the bound layers call in place of ``torch_chunk_gated_delta_rule``."""
        return self.path_for(query.device, query.dtype).chunk(query, key, value, **options)

    def _bind(self, layer: nn.Module, namespaces: dict[type, dict[str, Any]]) -> None:
        cls = type(layer)
        namespace = namespaces.get(cls)
        inner = inspect.unwrap(cls.forward)  # under transformers' accelerate-hook decorator
        if namespace is None:
            namespace = dict(inner.__globals__)
            namespace.update({n: f for n, f in self._torch_kernels.items() if n in namespace})
            namespace[_CHUNK] = self.chunk_gated_delta_rule
            namespaces[cls] = namespace
        forward = types.FunctionType(inner.__code__, namespace, inner.__name__, inner.__defaults__, inner.__closure__)
        forward.__kwdefaults__ = inner.__kwdefaults__
        layer.forward = types.MethodType(forward, layer)


def _forward_names(cls: type) -> frozenset[str]:
    forward = getattr(cls, "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    return frozenset(code.co_names) if code is not None else frozenset()


def _torch_kernels(cls: type) -> dict[str, Callable[..., Any]]:
    """transformers' own torch functions behind the kernel names of ``cls``'s module (their decorators
    keep each as ``__wrapped__``); a name that does not lead to a function of that module is refused, so a
    transformers release that changes how it picks kernels fails here, not silently."""
    module = importlib.import_module(cls.__module__)
    found = {}
    for name in _KERNEL_NAMES:
        wrapper = getattr(module, name, None)
        if wrapper is None:
            continue
        function = inspect.unwrap(wrapper)
        if getattr(function, "__module__", None) != module.__name__:
            raise TypeError(f"{module.__name__}.{name} does not wrap that module's torch function")
        found[name] = function
    if _CHUNK not in found:
        raise TypeError(f"{module.__name__} has no {_CHUNK}")
    return found


def _is_cuda_fault(error: BaseException) -> bool:
    return type(error).__name__ == "AcceleratorError" or "CUDA error" in str(error)


def _parsed(version: str) -> Any:
    """``packaging``'s Version of ``version``, or version 0 for a string it cannot read (a local build)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version)
    except InvalidVersion:
        return Version("0")


def _version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
