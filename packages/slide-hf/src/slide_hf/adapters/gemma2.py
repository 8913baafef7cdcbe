"""Gemma 2: scaled embeddings, sandwich norms, soft-capped logits, alternating sliding-window layers.

* Embedding: HF's ``Gemma2TextScaledWordEmbedding`` multiplies by ``sqrt(hidden)`` cast to the weight's
  dtype (in bf16, sqrt(3584) = 59.87 becomes 60.0, and checkpoints are trained with that). The scale is a
  non-persistent buffer; a meta buffer has no value, so the adapter supplies it.
* Norms compute ``(1 + w) * x``: fresh weights are zeros, not ones (``norm_init``).
* Blocks: HF's layer carries the pre/post attention and feed-forward norms and the attention-logit
  softcap; ``config.layer_types`` says which layers are sliding (even) and full (odd), and the base class
  hands each its own mask.
* Attention: the logit cap (``attn_logit_softcapping``, 50 in every released checkpoint) is applied by
  HF's eager, flex and flash-attn paths, never by sdpa, which drops it without a word. The base class
  therefore chooses per layer type and device (slide_hf/adapters/attention.py): flash-attn when
  installed on CUDA, else flex_attention on CUDA and eager on the CPU; an explicit sdpa is refused.
* Head: ``final_logit_softcapping`` is read from the config by the base head and passed to the loss.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.gemma2.modeling_gemma2 import (
    Gemma2DecoderLayer,
    Gemma2RMSNorm,
    Gemma2RotaryEmbedding,
    Gemma2TextScaledWordEmbedding,
)

from slide_hf.adapters.base import BufferFactory, HFCausalLM

__all__ = ["Gemma2Adapter"]


class Gemma2Adapter(HFCausalLM):
    """``model_type == "gemma2"``."""

    decoder_layer = Gemma2DecoderLayer
    rotary_embedding = Gemma2RotaryEmbedding
    norm_init = 0.0

    def make_embedding(self) -> nn.Module:
        c = self.config
        return Gemma2TextScaledWordEmbedding(
            c.vocab_size, c.hidden_size, c.pad_token_id, embed_scale=c.hidden_size**0.5
        )

    def embedding_buffers(self) -> dict[str, BufferFactory]:
        scale = self.config.hidden_size**0.5
        return {f"{self.embed_name}.embed_scale": lambda: torch.tensor(scale)}

    def make_norm(self) -> nn.Module:
        return Gemma2RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
