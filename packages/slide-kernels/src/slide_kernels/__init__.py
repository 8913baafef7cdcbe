"""slide-kernels: fused Triton kernels (with pure-torch fallbacks) for SlideFormer.

Public API (see ``docs/kernels.md``):

* :func:`linear_cross_entropy` -- LM head + cross-entropy without materializing the logits;
* :func:`rms_norm`, :func:`apply_rotary`, :func:`swiglu`, :func:`geglu` -- fused elementwise/row ops;
* :func:`kernels_available` -- whether Triton kernels can run on a device type (``slide doctor``);
* :func:`use_backend` -- force the torch fallback (tests, debugging).

Importing this package is cheap and needs no triton: the op modules (and triton, if installed) are
imported on first access to one of these names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "apply_rotary",
    "geglu",
    "kernels_available",
    "linear_cross_entropy",
    "rms_norm",
    "swiglu",
    "use_backend",
]

_LAZY = {
    "apply_rotary": "slide_kernels.ops.rope",
    "geglu": "slide_kernels.ops.swiglu",
    "kernels_available": "slide_kernels._backend",
    "linear_cross_entropy": "slide_kernels.ops.linear_cross_entropy",
    "rms_norm": "slide_kernels.ops.rms_norm",
    "swiglu": "slide_kernels.ops.swiglu",
    "use_backend": "slide_kernels._backend",
}

if TYPE_CHECKING:
    from slide_kernels._backend import kernels_available, use_backend
    from slide_kernels.ops.linear_cross_entropy import linear_cross_entropy
    from slide_kernels.ops.rms_norm import rms_norm
    from slide_kernels.ops.rope import apply_rotary
    from slide_kernels.ops.swiglu import geglu, swiglu


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'slide_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
