"""Qwen3-MoE: Qwen3 attention (q/k norms) with a top-k routed mixture of experts in the MLP.

In memory HF (transformers 5) keeps each layer's experts fused: ``mlp.experts.gate_up_proj`` of shape
(experts, 2 * moe_intermediate, hidden) and ``mlp.experts.down_proj`` (experts, hidden,
moe_intermediate); the router is ``mlp.gate.weight``. Checkpoints on disk -- the Hub's and what
``save_pretrained`` writes -- keep one ``gate_proj`` / ``up_proj`` / ``down_proj`` per expert. The
:class:`CheckpointSlice` entries below say where each on-disk tensor sits inside the fused parameter, so
loading and export stream them one by one with no conversion pass.

The router's auxiliary load-balancing loss is not added (HF adds it only with ``output_router_logits``,
which is off by default in Qwen3-MoE configs).
"""

from __future__ import annotations

from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
)

from slide_hf.adapters.base import BlockUnit, CheckpointSlice, HFCausalLM

__all__ = ["Qwen3MoeAdapter"]


class Qwen3MoeAdapter(HFCausalLM):
    """``model_type == "qwen3_moe"``."""

    decoder_layer = Qwen3MoeDecoderLayer
    rotary_embedding = Qwen3MoeRotaryEmbedding

    def make_norm(self) -> nn.Module:
        return Qwen3MoeRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)

    def make_block_unit(self, index: int) -> BlockUnit:
        unit = super().make_block_unit(index)
        if "mlp.experts.gate_up_proj" not in unit.layout:
            return unit  # a dense layer (mlp_only_layers / decoder_sparse_step)
        prefix = f"{self.base_prefix}{self.layers_name}.{index}.mlp.experts"
        inter = self.config.moe_intermediate_size
        experts = range(self.config.num_experts)
        unit.checkpoint_slices["mlp.experts.gate_up_proj"] = tuple(
            CheckpointSlice(f"{prefix}.{e}.{proj}.weight", (e, rows))
            for e in experts
            for proj, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter)))
        )
        unit.checkpoint_slices["mlp.experts.down_proj"] = tuple(
            CheckpointSlice(f"{prefix}.{e}.down_proj.weight", (e,)) for e in experts
        )
        return unit
