"""Backend selection: Triton kernels or the pure-torch fallback.

Every op in :mod:`slide_kernels.ops` has two implementations of the same math: a Triton kernel and a
plain-PyTorch fallback. This module decides which one runs for a given tensor:

* Triton, when ``triton`` imports and the tensor is on a CUDA (or ROCm, which torch also calls
  ``cuda``) device, or when Triton's interpreter is on (``TRITON_INTERPRET=1`` in the environment
  *before* triton was imported) and the tensor is on the CPU;
* the torch fallback otherwise (no triton, CPU without the interpreter, MPS, XPU, ...).

``SLIDE_KERNELS_BACKEND=torch`` (or :func:`use_backend`) forces the fallback, which is how the tests
check the fallback against the same references; ``=triton`` forces Triton and fails loudly where it
cannot run.

Triton is imported lazily, once, the first time an op module is imported. When it is missing,
:data:`triton` and :data:`tl` are stand-ins whose ``jit`` decorator returns the function unchanged, so
the op modules still import and their fallbacks still work.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

import torch

from slide_core.device import num_warps_for as _core_num_warps_for

__all__ = [
    "HAS_TRITON",
    "Backend",
    "interpret_mode",
    "kernels_available",
    "num_warps_for",
    "tl",
    "triton",
    "use_backend",
    "use_triton",
]

Backend = Literal["auto", "triton", "torch"]


def _import_triton() -> tuple[types.ModuleType, types.ModuleType, bool]:
    try:
        import triton as _triton
        import triton.language as _tl
    except Exception:  # ImportError, or a broken install (missing driver libs, ...)
        stub_triton = types.ModuleType("triton_stub")
        stub_tl = types.ModuleType("triton_language_stub")

        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        stub_triton.jit = jit  # type: ignore[attr-defined]
        stub_triton.next_power_of_2 = _next_power_of_2  # type: ignore[attr-defined]
        stub_triton.cdiv = lambda a, b: -(-a // b)  # type: ignore[attr-defined]
        stub_tl.constexpr = object  # type: ignore[attr-defined]
        return stub_triton, stub_tl, False
    return _triton, _tl, True


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


if TYPE_CHECKING:
    # The type checker sees the real modules (unannotated, so every name in them is Any), which makes the
    # kernels' ``tl.constexpr`` parameter annotations types; at run time, the modules or their stand-ins.
    import triton
    import triton.language as tl

    HAS_TRITON: bool
else:
    triton, tl, HAS_TRITON = _import_triton()

_override: Backend | None = None


def _env_backend() -> Backend:
    value = os.environ.get("SLIDE_KERNELS_BACKEND", "auto").strip().lower()
    if value not in ("auto", "triton", "torch"):
        raise ValueError(f"SLIDE_KERNELS_BACKEND must be auto, triton or torch, got {value!r}")
    return value  # type: ignore[return-value]


def interpret_mode() -> bool:
    """Whether Triton's CPU interpreter is on (``TRITON_INTERPRET=1``).

    It must have been set before triton was imported, since ``triton.jit`` reads it when the kernels
    are decorated; setting it later leaves compiled-for-GPU kernels that cannot take CPU tensors.
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def _cuda_usable() -> bool:
    return torch.cuda.is_available()


def kernels_available(device_type: str = "cuda") -> bool:
    """Whether the Triton kernels can run for tensors on ``device_type`` (for ``slide doctor``).

    ``"cuda"`` needs triton and a visible CUDA/ROCm device; ``"cpu"`` needs triton and the
    interpreter (``TRITON_INTERPRET=1``), which is only meant for tests. Anything else runs the
    torch fallback, which is always available.
    """
    if not HAS_TRITON:
        return False
    if device_type == "cuda":
        return _cuda_usable()
    if device_type == "cpu":
        return interpret_mode()
    return False


def use_triton(*tensors: torch.Tensor) -> bool:
    """Decide, for the device of ``tensors[0]``, whether to launch Triton kernels.

    Forcing ``triton`` where it cannot run raises instead of silently falling back.
    """
    choice = _override if _override is not None else _env_backend()
    if choice == "torch":
        return False
    device_type = tensors[0].device.type
    ok = HAS_TRITON and (device_type == "cuda" or (device_type == "cpu" and interpret_mode()))
    if choice == "triton" and not ok:
        raise RuntimeError(
            f"slide_kernels backend 'triton' was forced but cannot run on {device_type!r} tensors "
            f"(triton importable: {HAS_TRITON}, TRITON_INTERPRET: {interpret_mode()})"
        )
    return ok


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    """Force ``"torch"`` (or ``"triton"``, or back to ``"auto"``) inside a ``with`` block.

    Not thread-safe: it flips a module-level switch; meant for tests and benchmarks.
    """
    global _override
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    previous, _override = _override, backend
    try:
        yield
    finally:
        _override = previous


def num_warps_for(block_size: int) -> int:
    """Warps per program for a row-wise kernel whose widest block has ``block_size`` elements.

    slide-core's one rule (:func:`slide_core.device.num_warps_for`, which slide-rocm's launch parameters
    use too) for this torch build's GPUs: wavefronts of 64 and at most 16 per workgroup on ROCm, warps of
    32 and at most 32 on CUDA.
    """
    if torch.version.hip:
        return _core_num_warps_for(block_size, warp_size=64, max_num_warps=16)
    return _core_num_warps_for(block_size, warp_size=32, max_num_warps=32)
