"""What a run defaults to because of its device: the device plugin's policy reaching the run.

A device plugin knows its hardware's good choices (slide-rocm's ``ROCmPolicy``: SDPA on AOTriton or its
build of flash-attn, and never GPUDirect Storage). slide-hf asks the device (``Device.preferred_attention``,
``Device.preferred_activation_tier``) wherever it picks for a user who chose nothing: the attention here,
once the model and the device of a run meet; the activation tier where it is opened
(:func:`slide_hf.offload.open_activation_tier`).
"""

from __future__ import annotations

from typing import Any

from slide_core.device import Device

__all__ = ["apply_device_defaults"]


def apply_device_defaults(model: Any, device: Device) -> None:
    """Hand ``device``'s preferences to ``model``: an HF adapter's model tries the device's attention
    first for every layer that can run it (``HFCausalLM.prefer_attention``). Other models take none."""
    from slide_hf.adapters.base import HFCausalLM

    if isinstance(model, HFCausalLM):
        model.prefer_attention(device.preferred_attention())
