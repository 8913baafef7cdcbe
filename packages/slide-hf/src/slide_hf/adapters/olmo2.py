"""OLMo 2: Llama's layout with the norms moved after the sublayers, and q/k norms over all heads.

* Blocks: HF's layer has no input norm; ``post_attention_layernorm`` and ``post_feedforward_layernorm``
  normalise each sublayer's output before it joins the residual stream.
* Attention: ``q_norm`` / ``k_norm`` are RMSNorms over the whole projection (``heads * head_dim``), not
  per head as in Qwen3, so their weights are ``(hidden,)`` and ``(kv_heads * head_dim,)``.
* Norms multiply by the weight in fp32 before rounding to the input dtype (Llama rounds first); the
  fused RMSNorm reads that from the module's code (Note [Fused modules are checked, not named]).
* One rotary table, every layer full causal attention, untied head in every release.
"""

from __future__ import annotations

from torch import nn
from transformers.models.olmo2.modeling_olmo2 import (
    Olmo2DecoderLayer,
    Olmo2RMSNorm,
    Olmo2RotaryEmbedding,
)

from slide_hf.adapters.base import HFCausalLM

__all__ = ["Olmo2Adapter"]


class Olmo2Adapter(HFCausalLM):
    """``model_type == "olmo2"``."""

    decoder_layer = Olmo2DecoderLayer
    rotary_embedding = Olmo2RotaryEmbedding

    def make_norm(self) -> nn.Module:
        return Olmo2RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
