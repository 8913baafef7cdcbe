"""Qwen3-Next: gated delta-net (linear attention) layers between gated full-attention layers, and a
mixture of experts with a shared expert in every layer.

* Layer types: ``config.layer_types`` marks three layers in four ``linear_attention`` (a
  ``Qwen3NextGatedDeltaNet``: a causal depthwise convolution, then the chunked gated delta rule) and the
  fourth ``full_attention`` (sigmoid-gated output, q/k norms, rotary on a quarter of each head).
  Linear layers get HF's recurrent mask (None without padding) and no attention implementation.
* Linear attention runs HF's own layer code with the delta rule chosen per device by
  ``linear_attention.py``: flash-linear-attention's kernel on a GPU where ``slide-hf[fla]`` is installed
  and passes its checks, transformers' torch path elsewhere (the CPU, the planner's meta device, Hopper
  with Triton < 3.7.1, ``SLIDE_LINEAR_ATTENTION=torch``). In training there
  is no cache: ``past_key_values`` is None, so the convolution and recurrent states start at zero on
  every call and nothing outlives it -- a block recomputed in backward computes exactly its forward.
  For the same reason nothing keeps packed documents apart inside a linear layer, so packed rows are
  refused (``RECURRENT_LAYER_TYPES`` in base.py).
* Norms compute ``(1 + w) * x`` in fp32 (fresh weights zero); the delta net's output norm is a gated
  ``w * x`` norm (weights one), left to HF.
* Experts are fused in memory and stored one by one on disk (moe_experts.py); the router's auxiliary
  loss is not added (HF adds it only with ``output_router_logits``).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextRMSNorm,
    Qwen3NextRotaryEmbedding,
)

from slide_core.unit import Unit
from slide_hf.adapters.base import BlockUnit, HFCausalLM
from slide_hf.adapters.moe_experts import split_experts

__all__ = ["Qwen3NextAdapter", "delta_net_init_rule"]


def delta_net_init_rule(name: str) -> tuple[str, float] | None:
    """HF's initial values of a gated delta net's 1-d parameters, or None for anything else.

    ``dt_bias`` and the gated output norm start at one. HF draws each head's decay rate ``A`` from
    U(0.01, 16); :func:`~slide_hf.presets.init_random` has constants and normals only, so every head
    starts at that range's mean, ``A_log = log(8)``.
    """
    if name.endswith(("linear_attn.dt_bias", "linear_attn.norm.weight")):
        return "constant", 1.0
    if name.endswith("linear_attn.A_log"):
        return "constant", 2.0794415416798357  # log(8)
    return None


class Qwen3NextAdapter(HFCausalLM):
    """``model_type == "qwen3_next"``."""

    decoder_layer: ClassVar[type[nn.Module]] = Qwen3NextDecoderLayer
    rotary_embedding = Qwen3NextRotaryEmbedding
    norm_init = 0.0

    def make_norm(self) -> nn.Module:
        return Qwen3NextRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)

    def make_block_unit(self, index: int) -> BlockUnit:
        unit = super().make_block_unit(index)
        c = self.config
        split_experts(unit, f"{self.base_prefix}{self.layers_name}.{index}.", c.num_experts, c.moe_intermediate_size)
        return unit

    def init_rule(self, unit: Unit, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
        return delta_net_init_rule(name) or super().init_rule(unit, name, shape)
