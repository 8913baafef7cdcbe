"""Llama 2/3.x (tied and untied heads): the reference family the base class is written for.

Everything is the default: ``model.`` prefix, ``embed_tokens`` / ``layers`` / ``norm`` names, RMSNorm
weights initialised to one, rotary from ``LlamaRotaryEmbedding`` (which also handles Llama 3's
``rope_type="llama3"`` frequency scaling), causal masks only. Tying comes from
``config.tie_word_embeddings`` (Llama 3.2 1B/3B tie, 3.1 8B does not).
"""

from __future__ import annotations

from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from slide_hf.adapters.base import HFCausalLM

__all__ = ["LlamaAdapter"]


class LlamaAdapter(HFCausalLM):
    """``model_type == "llama"``."""

    decoder_layer = LlamaDecoderLayer
    rotary_embedding = LlamaRotaryEmbedding

    def make_norm(self) -> nn.Module:
        return LlamaRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
