"""Mistral: Llama's layout with grouped-query attention and an optional sliding window.

The window is a config value (``sliding_window``; null in v0.2+/v0.3 checkpoints, 4096 in v0.1). HF picks
its sliding-window mask for every layer whenever it is set, and so does the base class's default
:meth:`attention_type`; the attention module itself passes the window to the kernel.
"""

from __future__ import annotations

from torch import nn
from transformers.models.mistral.modeling_mistral import (
    MistralDecoderLayer,
    MistralRMSNorm,
    MistralRotaryEmbedding,
)

from slide_hf.adapters.base import HFCausalLM

__all__ = ["MistralAdapter"]


class MistralAdapter(HFCausalLM):
    """``model_type == "mistral"``."""

    decoder_layer = MistralDecoderLayer
    rotary_embedding = MistralRotaryEmbedding

    def make_norm(self) -> nn.Module:
        return MistralRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
