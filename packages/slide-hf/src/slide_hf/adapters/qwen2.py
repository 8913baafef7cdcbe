"""Qwen2 / Qwen2.5: Llama's layout plus biases on the q/k/v projections.

The biases are ordinary parameters of HF's ``Qwen2Attention`` (1-dim, so they land in the no-decay tail
of the unit layout and are initialised to zero). Sliding-window layers, when ``use_sliding_window`` is
on, are listed by HF in ``config.layer_types``, which the base class follows layer by layer.
"""

from __future__ import annotations

from torch import nn
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2DecoderLayer,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
)

from slide_hf.adapters.base import HFCausalLM

__all__ = ["Qwen2Adapter"]


class Qwen2Adapter(HFCausalLM):
    """``model_type == "qwen2"``."""

    decoder_layer = Qwen2DecoderLayer
    rotary_embedding = Qwen2RotaryEmbedding

    def make_norm(self) -> nn.Module:
        return Qwen2RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
