"""Which of Hugging Face's attention implementations each layer type runs, on a given device.

Why a rule: HF's attention modules look ``config._attn_implementation`` up at call time, and the
implementations do not all compute the same thing. Gemma 2 caps every attention logit at
``attn_logit_softcapping * tanh(s / attn_logit_softcapping)``; HF's ``sdpa`` function takes that cap as
an unused keyword and drops it (PyTorch's SDPA has no place for it), so a Gemma-2 model run through
``sdpa`` trains a different network than the checkpoint's, without an error. The choice therefore
depends on what a layer needs (a logit cap, a sliding window), on the device, on the compute dtype and
on what is installed:

1. ``flash_attention_2`` when flash-attn is installed, the device is CUDA and the compute dtype is
   fp16/bf16 (the only dtypes its kernels take; HF would silently downcast an fp32 run). It applies
   sliding windows and, from flash-attn 2.6 on, the logit cap inside the kernel.
2. ``sdpa`` when the layer has no logit cap: PyTorch's fused kernels, and masks from HF's builders.
3. ``flex_attention`` for a capped layer on CUDA: torch compiles HF's ``score_mod`` (the cap) into one
   fused kernel that never holds the (S x S) scores, and HF's mask builders hand it a ``BlockMask`` for
   causal, sliding and packed-document masks. Its CPU path has no backward (torch 2.13), so it is
   never picked for the CPU.
4. ``eager`` for a capped layer anywhere else (the CPU): HF's reference path, exact, materialising the
   (S x S) scores, which the CPU can afford at the sequence lengths it trains.

0. Before all of these, the device's own preference (``Device.preferred_attention``: slide-rocm's
   policy says ``sdpa`` on AOTriton, or its build of flash-attn), where the layer can run it: never a
   ``sdpa`` that would drop a logit cap, never a flash-attn that is absent, not on fp16/bf16, or too old
   for the cap.

The rule runs once per layer type (what a layer needs is a property of its type: only sliding layers
have a window) for each (device type, dtype) an adapter meets, and the adapter caches the answer on
itself (:meth:`~slide_hf.adapters.base.HFCausalLM.attention_for`). A choice the user made
(``config._attn_implementation`` already set) is kept, except one that would silently drop a logit cap,
which is refused in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from slide_hf.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "EAGER",
    "FLASH",
    "FLEX",
    "SDPA",
    "AttentionSupport",
    "LayerAttention",
    "attention_summary",
    "choose_attention",
    "format_choices",
    "layer_attention",
    "requested_attention",
]

EAGER = "eager"
SDPA = "sdpa"
FLEX = "flex_attention"
FLASH = "flash_attention_2"

FLASH_SOFTCAP_VERSION = "2.6.0"
"""The first flash-attn release whose kernels take ``softcap``; HF drops the cap on older ones."""

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LayerAttention:
    """What one layer type's attention has to compute besides plain causal attention."""

    softcap: float | None = None
    """Attention-logit cap (Gemma 2's ``attn_logit_softcapping``)."""
    sliding_window: int | None = None
    """Keys a query sees in a sliding layer; ``None`` for full layers."""


@dataclass(frozen=True)
class AttentionSupport:
    """What a device type and compute dtype offer, as far as the rule cares."""

    device_type: str
    dtype: torch.dtype
    flash_attn: bool = False
    """flash-attn (HF's ``flash_attention_2``) is installed and usable on this device."""
    flash_attn_softcap: bool = False
    """... and new enough to apply a logit cap (>= 2.6)."""
    flex_attention: bool = True
    """torch has ``torch.nn.attention.flex_attention``."""
    preferred: str | None = None
    """The run's device's preference (``Device.preferred_attention``), tried first; None: none."""

    @classmethod
    def detect(cls, device_type: str, dtype: torch.dtype) -> AttentionSupport:
        """Ask transformers what is installed (it checks flash-attn's distribution and version)."""
        from transformers.utils import (
            is_flash_attn_2_available,
            is_flash_attn_greater_or_equal,
            is_torch_flex_attn_available,
        )

        flash = device_type == "cuda" and is_flash_attn_2_available()
        return cls(
            device_type,
            dtype,
            flash_attn=flash,
            flash_attn_softcap=flash and is_flash_attn_greater_or_equal(FLASH_SOFTCAP_VERSION),
            flex_attention=is_torch_flex_attn_available(),
        )


def choose_attention(layer: LayerAttention, support: AttentionSupport) -> str:
    """HF's ``_attn_implementation`` for ``layer`` under ``support``; see the module docstring for why."""
    cuda = support.device_type == "cuda"
    flash_fits = cuda and support.flash_attn and (layer.softcap is None or support.flash_attn_softcap)
    flash_fits = flash_fits and support.dtype in _HALF
    if support.preferred is not None and _runs(support.preferred, layer, support, flash_fits=flash_fits):
        return support.preferred
    if flash_fits:
        return FLASH
    if layer.softcap is None:
        return SDPA
    if cuda and support.flex_attention:
        return FLEX
    return EAGER


def _runs(implementation: str, layer: LayerAttention, support: AttentionSupport, *, flash_fits: bool) -> bool:
    """Whether ``implementation`` computes ``layer`` as the checkpoint does, and trains, here."""
    if implementation == FLASH:
        return flash_fits
    if implementation == SDPA:
        return layer.softcap is None
    if implementation == FLEX:  # no backward on the CPU
        return support.device_type == "cuda" and support.flex_attention
    return implementation == EAGER


def layer_attention(config: PreTrainedConfig, layer_type: str) -> LayerAttention:
    """What a layer of ``layer_type`` needs under ``config`` (HF's attribute names)."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    window = getattr(config, "sliding_window", None) if layer_type == "sliding_attention" else None
    return LayerAttention(float(softcap) if softcap else None, window)


def requested_attention(config: PreTrainedConfig, layer_types: list[str]) -> str | None:
    """The user's own ``config._attn_implementation``, or ``None`` when the rule should choose.

    Raises :class:`~slide_hf.errors.UserError` for a choice that would drop a layer's logit cap:
    ``sdpa`` (HF passes the cap to it and it ignores it), or ``flash_attention_2`` with a flash-attn
    older than 2.6 installed.
    """
    requested = config._attn_implementation
    if requested is None:
        return None
    capped = [t for t in layer_types if layer_attention(config, t).softcap is not None]
    if not capped:
        return requested
    cap = getattr(config, "attn_logit_softcapping", None)
    if requested == SDPA:
        raise UserError(
            f"attention 'sdpa' cannot apply {config.model_type}'s attention logit softcap "
            f"(attn_logit_softcapping={cap}) and would silently drop it; leave the attention implementation "
            f"unset (chosen per device), or set '{FLEX}', '{FLASH}' or '{EAGER}'"
        )
    if requested == FLASH:
        from transformers.utils import is_flash_attn_2_available, is_flash_attn_greater_or_equal

        if is_flash_attn_2_available() and not is_flash_attn_greater_or_equal(FLASH_SOFTCAP_VERSION):
            raise UserError(
                f"attention '{FLASH}' needs flash-attn >= {FLASH_SOFTCAP_VERSION} to apply {config.model_type}'s "
                f"attention logit softcap (attn_logit_softcapping={cap}); upgrade flash-attn or leave the "
                "attention implementation unset"
            )
    return requested


def format_choices(choices: Mapping[str, str]) -> str:
    """``"sliding_attention=flex_attention, full_attention=flex_attention"`` (layer types in model order)."""
    return ", ".join(f"{layer_type}={impl}" for layer_type, impl in choices.items())


def attention_summary(model_or_config: Any, device_type: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """One line saying which attention each layer type runs on ``device_type`` at ``dtype``.

    ``model_or_config`` is an adapter's model (its cached choice is reported, the one training uses) or
    an HF config (the model is built on the meta device to ask it). For logs and ``slide doctor``. A
    model from an adapter outside this package that does not say is reported as such.
    """
    from slide_core.unit import SlideModel

    model = model_or_config
    if not isinstance(model, SlideModel):
        from slide_hf.adapters import build_model

        model = build_model(model_or_config)
    attention_for = getattr(model, "attention_for", None)
    if attention_for is None:
        return f"chosen inside {type(model).__name__} (not reported)"
    return format_choices(attention_for(device_type, dtype))
