"""Llama 4 (the text model): chunked local attention on rotary layers, global attention without rotary
(NoPE) on every fourth, and a mixture of experts with a shared expert.

* Layer types: ``config.no_rope_layers[i]`` is 1 where layer ``i`` rotates; those layers attend within
  chunks of ``attention_chunk_size`` tokens (``chunked_attention``, HF's chunked mask), the others attend
  to everything (``full_attention``) and scale their queries by ``1 + attn_scale * log1p(floor((pos + 1)
  / floor_scale))`` (``attn_temperature_tuning``). HF computes that position, and the chunk boundaries,
  from the row, not from ``position_ids``: in a packed row both follow the row's positions, exactly as
  transformers does on the same row (they differ from an unpacked document only past 8192 tokens).
* Rotary: complex ``freqs_cis`` from ``Llama4TextRotaryEmbedding`` (Llama 3 frequency scaling), applied
  by HF's ``apply_rotary_emb``; slide-kernels' RoPE (real cos/sin) does not apply. Queries and keys of
  rotary layers get a weightless L2 norm (``use_qk_norm``).
* MLP: layers in ``config.moe_layers`` route each token to ``num_experts_per_tok`` of
  ``num_local_experts`` experts (sigmoid router scores) plus a shared expert; the others are dense with
  ``intermediate_size_mlp``. Experts are fused in memory and on disk alike. Each token goes through its
  chosen experts alone (slide_hf/adapters/llama4_moe.py), where HF's module runs it through all of them.
* transformers has no flash-attention path for Llama 4 (``_supports_flash_attn`` is False: its chunked
  masks need a mask), so the attention rule never picks flash-attn here and an explicit request is refused.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.models.llama4.modeling_llama4 import (
    Llama4TextDecoderLayer,
    Llama4TextRMSNorm,
    Llama4TextRotaryEmbedding,
)

from slide_hf.adapters.attention import AttentionSupport
from slide_hf.adapters.base import HFCausalLM
from slide_hf.adapters.llama4_moe import route_experts_by_token
from slide_hf.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["Llama4TextAdapter"]


class Llama4TextAdapter(HFCausalLM):
    """``model_type == "llama4_text"``."""

    decoder_layer = Llama4TextDecoderLayer
    rotary_embedding = Llama4TextRotaryEmbedding

    def __init__(self, config: PreTrainedConfig) -> None:
        requested = getattr(config, "_attn_implementation", None) or ""
        if requested.startswith("flash"):
            raise UserError(
                f"attention {requested!r} is not available for Llama 4 (transformers has no flash-attention path "
                "for its chunked attention); leave the attention implementation unset, or set 'sdpa', "
                "'flex_attention' or 'eager'"
            )
        super().__init__(config)

    def make_layer(self, index: int) -> nn.Module:
        layer = super().make_layer(index)
        route_experts_by_token(layer)
        return layer

    def make_norm(self) -> nn.Module:
        return Llama4TextRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)

    def attention_support(self, device_type: str, dtype: torch.dtype) -> AttentionSupport:
        support = super().attention_support(device_type, dtype)
        return dataclasses.replace(support, flash_attn=False, flash_attn_softcap=False)
