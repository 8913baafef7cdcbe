"""Gemma 3 (text): Gemma 2's scaled embedding and sandwich norms, q/k norms, five sliding layers per full
one, and a rotary table per layer type.

* Embedding: ``Gemma3TextScaledWordEmbedding`` multiplies by ``sqrt(hidden)`` cast to the weight's dtype
  (a non-persistent buffer the adapter supplies, as for Gemma 2).
* Norms compute ``(1 + w) * x`` in fp32: fresh weights are zeros (``norm_init``); the fused RMSNorm
  finds that form in the module's code. ``q_norm`` / ``k_norm`` are per-head norms of the same kind.
* Layer types: ``config.layer_types`` (sliding with ``sliding_window`` = 1024 in the releases, every
  sixth layer full); each type gets its own mask.
* Rotary: sliding layers rotate with base 10 000, full layers with base 1 000 000 and, in the 4B-27B
  releases, linear scaling by 8. ``Gemma3RotaryEmbedding`` answers per layer type; each block gets its
  type's table (:class:`~slide_hf.adapters.layer_rotary.LayerTypeRotaryLM`).
* The releases cap no logits; a config that sets ``attn_logit_softcapping`` gets the attention rule's
  capped path (eager on the CPU, flex_attention on CUDA) and ``final_logit_softcapping`` is applied by
  the head, as for Gemma 2.
* Only the text model (``model_type`` ``gemma3_text``, ``Gemma3ForCausalLM``: the 270M and 1B releases,
  or the text config of the larger ones) is built; ``use_bidirectional_attention`` (an encoder
  setting) is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3DecoderLayer,
    Gemma3RMSNorm,
    Gemma3RotaryEmbedding,
    Gemma3TextScaledWordEmbedding,
)

from slide_hf.adapters.base import BufferFactory
from slide_hf.adapters.layer_rotary import LayerTypeRotaryLM
from slide_hf.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["Gemma3Adapter"]


class Gemma3Adapter(LayerTypeRotaryLM):
    """``model_type == "gemma3_text"``."""

    decoder_layer = Gemma3DecoderLayer
    layer_rotary = Gemma3RotaryEmbedding
    norm_init = 0.0

    def __init__(self, config: PreTrainedConfig) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise UserError(
                "gemma3_text with use_bidirectional_attention=True attends both ways (an embedding "
                "encoder), not a causal LM; set it to false to fine-tune the causal model"
            )
        super().__init__(config)

    def make_embedding(self) -> nn.Module:
        c = self.config
        return Gemma3TextScaledWordEmbedding(
            c.vocab_size, c.hidden_size, c.pad_token_id, embed_scale=c.hidden_size**0.5
        )

    def embedding_buffers(self) -> dict[str, BufferFactory]:
        scale = self.config.hidden_size**0.5
        return {f"{self.embed_name}.embed_scale": lambda: torch.tensor(scale)}

    def make_norm(self) -> nn.Module:
        return Gemma3RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
