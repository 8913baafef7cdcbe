"""Qwen3.5 (the text model): Qwen3-Next's layer pattern -- gated delta-net layers, three in four,
between gated full-attention layers -- with a dense MLP, separate delta-net input projections and
multimodal rotary positions.

* Everything about the delta-net layers holds as in ``qwen3_next.py``: the delta rule chosen per device
  (``linear_attention.py``: flash-linear-attention's kernel or HF's torch path), no cache and no carried
  state in training, packed rows refused, the same HF initial values.
* Rotary: ``Qwen3_5TextRotaryEmbedding`` takes positions on three axes (time, height, width; interleaved
  by ``mrope_section``). For text all three are the token's position, which is what HF's model builds
  when it is given none; :class:`TextRotary` does that expansion, so the table equals the plain one.
* Norms compute ``(1 + w) * x`` (fresh weights zero).
* Only the text model is built (``model_type`` ``qwen3_5_text``, ``Qwen3_5ForCausalLM``); the released
  vision-language checkpoints (``qwen3_5``) store it under ``model.language_model.``, which is not read.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)

from slide_core.unit import Unit
from slide_hf.adapters.base import HFCausalLM
from slide_hf.adapters.qwen3_next import delta_net_init_rule

__all__ = ["Qwen3_5Adapter", "TextRotary"]


class TextRotary(Qwen3_5TextRotaryEmbedding):
    """Qwen3.5's rotary fed text positions: ``(B, S)`` ids become the same ids on all three axes."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.dim() == 2:
            position_ids = position_ids[None].expand(3, *position_ids.shape)
        return super().forward(x, position_ids)


class Qwen3_5Adapter(HFCausalLM):
    """``model_type == "qwen3_5_text"``."""

    decoder_layer = Qwen3_5DecoderLayer
    rotary_embedding = TextRotary
    norm_init = 0.0

    def make_norm(self) -> nn.Module:
        return Qwen3_5RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)

    def init_rule(self, unit: Unit, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
        return delta_net_init_rule(name) or super().init_rule(unit, name, shape)
