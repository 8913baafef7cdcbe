"""SmolLM3: Llama's blocks with rotary switched off on every fourth layer (NoPE).

* ``config.no_rope_layers[i]`` is 1 where layer ``i`` rotates queries and keys and 0 where it does not;
  HF's attention reads it at build time, so a NoPE layer simply ignores the rotary table it is handed.
  One table serves every rotating layer.
* ``use_sliding_window`` with ``sliding_window`` makes the NoPE layers slide (``config.layer_types``);
  the released models attend fully everywhere.
* The released models tie the head to the embedding.
"""

from __future__ import annotations

from torch import nn
from transformers.models.smollm3.modeling_smollm3 import (
    SmolLM3DecoderLayer,
    SmolLM3RMSNorm,
    SmolLM3RotaryEmbedding,
)

from slide_hf.adapters.base import HFCausalLM

__all__ = ["SmolLM3Adapter"]


class SmolLM3Adapter(HFCausalLM):
    """``model_type == "smollm3"``."""

    decoder_layer = SmolLM3DecoderLayer
    rotary_embedding = SmolLM3RotaryEmbedding

    def make_norm(self) -> nn.Module:
        return SmolLM3RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
