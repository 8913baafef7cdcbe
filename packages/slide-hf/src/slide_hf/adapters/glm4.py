"""GLM-4 (0414): sandwich norms, biased q/k/v, a fused gate-up MLP and partial interleaved rotary.

* Blocks: HF's layer normalises the input and the output of both sublayers (``input_layernorm``,
  ``post_self_attn_layernorm``, ``post_attention_layernorm``, ``post_mlp_layernorm``).
* Attention: q/k/v carry biases (``attention_bias``); rotary acts on the first half of each head
  (``partial_rotary_factor`` 0.5) and rotates interleaved pairs, not halves, so slide-kernels' RoPE
  (``rotate_half`` layout) is not used; HF's runs.
* MLP: one ``gate_up_proj`` matrix, split in HF's forward; the fused GLU (separate gate/up) does not
  apply. The RMSNorms are Llama's and are fused.
"""

from __future__ import annotations

from torch import nn
from transformers.models.glm4.modeling_glm4 import (
    Glm4DecoderLayer,
    Glm4RMSNorm,
    Glm4RotaryEmbedding,
)

from slide_hf.adapters.base import HFCausalLM

__all__ = ["Glm4Adapter"]


class Glm4Adapter(HFCausalLM):
    """``model_type == "glm4"``."""

    decoder_layer = Glm4DecoderLayer
    rotary_embedding = Glm4RotaryEmbedding

    def make_norm(self) -> nn.Module:
        return Glm4RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
