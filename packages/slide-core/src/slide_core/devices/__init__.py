"""Devices that ship with slide-core: the host CPU and CUDA. Others (``rocm``) are plugins.

Every device, these two included, is registered in the ``slide.devices`` entry-point group and chosen by
name through :mod:`slide_core.plugins`; :func:`auto_device_name` is the rule behind ``--device auto``.
"""

from __future__ import annotations

import torch

__all__ = ["auto_device_name"]


def auto_device_name() -> str:
    """``"rocm"`` when torch is a HIP build with a visible GPU, ``"cuda"`` with a visible CUDA GPU, else
    ``"cpu"``. ROCm builds drive AMD GPUs through the ``torch.cuda`` API, so the build, not the API,
    tells them apart."""
    if not torch.cuda.is_available():
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"
