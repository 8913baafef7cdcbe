"""Qwen3.5-MoE (the text model): Qwen3.5's delta-net and gated-attention layers (see ``qwen3_5.py``) with
a mixture of experts and a shared expert in every layer (``qwen3_5_moe_text``).

Experts are fused in memory and stored one by one on disk (moe_experts.py); the router's auxiliary loss
is not added (HF adds it only with ``output_router_logits``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeTextRotaryEmbedding,
)

from slide_hf.adapters.qwen3_next import Qwen3NextAdapter

__all__ = ["Qwen3_5MoeAdapter"]


class _TextRotary(Qwen3_5MoeTextRotaryEmbedding):
    """Text positions on all three rotary axes (as ``qwen3_5.TextRotary``)."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.dim() == 2:
            position_ids = position_ids[None].expand(3, *position_ids.shape)
        return super().forward(x, position_ids)


class Qwen3_5MoeAdapter(Qwen3NextAdapter):
    """``model_type == "qwen3_5_moe_text"``: Qwen3-Next's units (experts split one by one, delta-net init)
    with Qwen3.5's layers, norms and three-axis text rotary."""

    decoder_layer = Qwen3_5MoeDecoderLayer
    rotary_embedding = _TextRotary

    def make_norm(self) -> nn.Module:
        return Qwen3_5MoeRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
