"""DeepSeek-V3 (and V3-shaped releases such as Moonlight): multi-head latent attention, dense first layers,
then a mixture of experts with group-limited routing and shared experts.

* Attention (MLA): queries through a low-rank pair ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (or one
  ``q_proj`` when ``q_lora_rank`` is None); keys and values from one compressed latent
  (``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` -> ``kv_b_proj``) plus a single rotary key part shared by
  all heads (decoupled rope: ``qk_rope_head_dim`` of each head rotates, ``qk_nope_head_dim`` does not).
  Released configs rotate interleaved pairs (``rope_interleave``), which HF's own function computes;
  slide-kernels' RoPE is used only for the ``rotate_half`` layout.
* MLP: the first ``first_k_dense_replace`` layers are dense; the others score experts with a sigmoid, keep
  the best ``topk_group`` of ``n_group`` groups (a group scores its two best experts), take the top
  ``num_experts_per_tok`` there, scale by ``routed_scaling_factor``, and add ``n_shared_experts`` shared
  experts. Experts are fused in memory, one tensor per expert on disk (moe_experts.py).
* ``mlp.gate.e_score_correction_bias`` shifts the expert choice (never the weights; DeepSeek's auxiliary-
  loss-free balancing). HF keeps it as a persistent buffer: in checkpoints, never trained. Here it is a
  unit parameter (Note [Buffers carried as parameters]) so it travels with the weights through loading,
  run checkpoints and export; it never receives a gradient, so AdamW (no decay on 1-d tensors) leaves it
  exactly as loaded. It is not counted as a parameter (``HFUnit.buffer_params``). On the GPU it is read in
  the compute dtype, where HF keeps it in fp32 (``_keep_in_fp32_modules_strict``): an expert whose
  corrected score ties another's within bf16 rounding may be chosen differently than by transformers.
* The multi-token-prediction layer of the released V3 checkpoints (``model.layers.61``) is not trained;
  transformers ignores it too.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

from slide_core.unit import Unit
from slide_hf.adapters.base import BlockUnit, HFCausalLM
from slide_hf.adapters.moe_experts import split_experts

__all__ = ["DeepseekV3Adapter"]

_CORRECTION = "mlp.gate.e_score_correction_bias"


class DeepseekV3Adapter(HFCausalLM):
    """``model_type == "deepseek_v3"``."""

    decoder_layer = DeepseekV3DecoderLayer
    rotary_embedding = DeepseekV3RotaryEmbedding

    def make_norm(self) -> nn.Module:
        return DeepseekV3RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)

    def make_layer(self, index: int) -> nn.Module:
        layer = super().make_layer(index)
        if index >= self.config.first_k_dense_replace:
            router = layer.get_submodule("mlp.gate")
            bias = cast(torch.Tensor, router.e_score_correction_bias)  # a buffer, until the next line
            del router._buffers["e_score_correction_bias"]
            router.e_score_correction_bias = nn.Parameter(torch.zeros_like(bias), requires_grad=False)
        return layer

    def make_block_unit(self, index: int) -> BlockUnit:
        unit = super().make_block_unit(index)
        c = self.config
        split_experts(
            unit, f"{self.base_prefix}{self.layers_name}.{index}.", c.n_routed_experts, c.moe_intermediate_size
        )
        if _CORRECTION in unit.layout:
            unit.buffer_params = frozenset({_CORRECTION})
        return unit

    def init_rule(self, unit: Unit, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
        if name == _CORRECTION:
            return "constant", 0.0  # HF's initial value: no correction
        return super().init_rule(unit, name, shape)
