"""What this process's torch knows about HIP, and which optional AMD Python modules import.

Everything here is asked at call time, never cached at import: tests simulate a HIP build by patching
``torch.version.hip`` and ``torch.cuda``, and a cache would keep answering for the build seen first.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import torch

__all__ = [
    "FLASH_ATTN_MODULES",
    "HIPFILE_MODULES",
    "gcn_arch_name",
    "hip_version",
    "is_rocm_build",
    "probe_module",
]

HIPFILE_MODULES: tuple[str, ...] = ("hipfile", "rocm.hipfile")
"""Where AMD's hipFile Python bindings may live: the ``hipfile`` wheel built from ROCm/hipFile, and the
``rocm.hipfile`` wrapper of the newer HIP Python packages. The bindings are young and their names move."""

FLASH_ATTN_MODULES: tuple[str, ...] = ("flash_attn",)
"""The ROCm build of flash-attention (ROCm/flash-attention, CK or Triton backend) keeps the upstream name."""


def hip_version() -> str | None:
    """``torch.version.hip`` (e.g. ``"6.2.41133"``) on a ROCm build of torch, else None."""
    version = getattr(torch.version, "hip", None)
    return str(version) if version else None


def is_rocm_build() -> bool:
    """True when this torch was built for ROCm: ``torch.cuda`` then drives HIP, not CUDA."""
    return hip_version() is not None


def gcn_arch_name(index: int = 0) -> str | None:
    """The full GPU target of device ``index`` (``"gfx942:sramecc+:xnack-"``), or None without one.

    It is read from ``gcnArchName`` in the device properties, which only ROCm builds of torch report.
    """
    if not is_rocm_build() or not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    name = getattr(torch.cuda.get_device_properties(index), "gcnArchName", None)
    return str(name) if name else None


def probe_module(candidates: Iterable[str]) -> str | None:
    """Import each candidate in turn and return the first name that imports, or None.

    Only ImportError and OSError (a missing shared library under the bindings) count as "absent"; any other
    exception is a broken install and should be seen, not hidden behind a silent fallback.
    """
    for name in candidates:
        try:
            importlib.import_module(name)
        except (ImportError, OSError):
            continue
        return name
    return None
