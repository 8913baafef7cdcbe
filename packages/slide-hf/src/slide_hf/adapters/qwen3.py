"""Qwen3 (dense): Llama's layout plus per-head RMSNorm on queries and keys (``q_norm`` / ``k_norm``).

The q/k norms live inside HF's ``Qwen3Attention``, so they are just more parameters of the block unit
(``self_attn.q_norm.weight``, shape ``(head_dim,)``, initialised to one). ``head_dim`` is explicit in
Qwen3 configs (128) and not hidden/heads.
"""

from __future__ import annotations

from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from slide_hf.adapters.base import HFCausalLM

__all__ = ["Qwen3Adapter"]


class Qwen3Adapter(HFCausalLM):
    """``model_type == "qwen3"``."""

    decoder_layer = Qwen3DecoderLayer
    rotary_embedding = Qwen3RotaryEmbedding

    def make_norm(self) -> nn.Module:
        return Qwen3RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
