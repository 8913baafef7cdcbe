"""Ministral 3 (the text model of Mistral 3): Mistral's blocks with YaRN rotary and Llama-4 query scaling.

* Rotary: ``rope_parameters`` is YaRN (factor 16 over 16k positions in the releases).
* Queries are multiplied by ``1 + beta * log(1 + floor(position / original_max_position_embeddings))``
  (``llama_4_scaling_beta``) inside HF's attention, from the ``position_ids`` each block receives, so
  packed rows, whose positions restart per document, scale as HF does for the same positions.
* ``sliding_window``, when set, makes every layer slide (None in the releases).
* The 3B ties the head to the embedding; the 8B and 14B do not.
"""

from __future__ import annotations

from torch import nn
from transformers.models.ministral3.modeling_ministral3 import (
    Ministral3DecoderLayer,
    Ministral3RMSNorm,
    Ministral3RotaryEmbedding,
)

from slide_hf.adapters.base import HFCausalLM

__all__ = ["Ministral3Adapter"]


class Ministral3Adapter(HFCausalLM):
    """``model_type == "ministral3"``."""

    decoder_layer = Ministral3DecoderLayer
    rotary_embedding = Ministral3RotaryEmbedding

    def make_norm(self) -> nn.Module:
        return Ministral3RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
