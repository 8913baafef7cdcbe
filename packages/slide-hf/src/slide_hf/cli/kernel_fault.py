"""Which installed package a CUDA error came from, for ``slide``'s one-line error report.

Why: a CUDA error (``torch.AcceleratorError``, or a ``RuntimeError`` saying ``CUDA error``) raised while a
third-party kernel runs -- flash-linear-attention's Triton kernels, flash-attn -- is that package's
fault on this GPU and software stack, and the user's way out is to run without it, not to report a bug in
slide. The traceback says whose code was running: walking from the innermost frame outwards, frames of
the libraries that merely launch or surface a kernel (torch, triton, Python's standard library) are
skipped, and the first other frame decides: slide's own packages mean slide's error (its kernels run
through triton too), anything else names that package.
"""

from __future__ import annotations

import importlib.metadata
import sys
import traceback

__all__ = ["third_party_fault"]

_OURS = frozenset({"slide_core", "slide_hf", "slide_kernels", "slide_io", "slide_rocm"})
_CARRIERS = frozenset({"torch", "triton"}) | frozenset(getattr(sys, "stdlib_module_names", ()))
_DISTRIBUTIONS = {"fla": "flash-linear-attention", "flash_attn": "flash-attn"}
"""Import name -> the distribution users install, where it differs (fla's modules ship in fla-core)."""


def third_party_fault(error: BaseException) -> str | None:
    """The report for a CUDA error in ``error``'s cause/context chain raised inside a package that is not
    slide's: ``"a CUDA error was raised inside flash-linear-attention 0.6.0 (fla.ops...): ... -- ..."``;
    None for any other error, and for a CUDA error raised in slide's own code."""
    fault = _cuda_fault(error)
    if fault is None:
        return None
    module = _failing_module(fault)
    if module is None:
        return None
    top = module.split(".")[0]
    package = _DISTRIBUTIONS.get(top, top)
    version = _version(top, package)
    named = f"{package} {version}" if version else package
    hint = _hint(top)
    return (
        f"a CUDA error was raised inside {named} ({module}): {_first_line(fault)} -- a failure of that "
        f"package's kernel on this GPU, not of slide; {hint}"
    )


def _cuda_fault(error: BaseException) -> BaseException | None:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if type(current).__name__ == "AcceleratorError" or (
            isinstance(current, RuntimeError) and "CUDA error" in str(current)
        ):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _failing_module(error: BaseException) -> str | None:
    """The module of the innermost frame that is neither a kernel carrier nor slide's; None if slide's."""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    for frame in reversed(frames):
        module = str(frame.f_globals.get("__name__", ""))
        top = module.split(".")[0]
        if not module or top in _CARRIERS:
            continue
        return None if top in _OURS else module
    return None


def _version(top: str, distribution: str) -> str | None:
    loaded = sys.modules.get(top)
    version = getattr(loaded, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _hint(top: str) -> str:
    if top == "fla":
        from slide_hf.adapters.linear_attention import ENV_VAR, TORCH

        return f"run with {ENV_VAR}={TORCH} to train linear attention on transformers' torch path instead"
    return "run without that package (uninstall it) or report the error to its maintainers"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
