"""Phi-3 / Phi-3.5 / Phi-4-mini: fused ``qkv_proj`` and ``gate_up_proj`` projections.

HF checkpoints store the fused matrices as-is, so the fused parameters map 1:1 to state-dict keys and
need no splitting. Rotary may be ``longrope`` (short/long factors chosen from the sequence length):
``Phi3RotaryEmbedding`` does that from the position ids we give it. Phi-3's residual dropouts are
``nn.Dropout`` modules that the unit keeps in eval mode.
"""

from __future__ import annotations

from torch import nn
from transformers.models.phi3.modeling_phi3 import (
    Phi3DecoderLayer,
    Phi3RMSNorm,
    Phi3RotaryEmbedding,
)

from slide_hf.adapters.base import HFCausalLM

__all__ = ["Phi3Adapter"]


class Phi3Adapter(HFCausalLM):
    """``model_type == "phi3"``."""

    decoder_layer = Phi3DecoderLayer
    rotary_embedding = Phi3RotaryEmbedding

    def make_norm(self) -> nn.Module:
        return Phi3RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
