"""Gemma 4 (text): sliding and full layers of different shapes, q/k/v norms, sandwich norms, a scaled
embedding, a capped head, and an optional mixture of experts beside the dense MLP.

* Layer types: ``config.layer_types`` (five sliding layers per full one in the releases, the last layer
  always full). Full layers have their own head size (``global_head_dim``) and, with
  ``attention_k_eq_v``, their own kv-head count (``num_global_key_value_heads``) and no ``v_proj``:
  values are the key projection, normed without a weight. HF resolves those per layer
  (``config.per_layer_config``) when it builds a layer, so the units get each layer's own shapes.
* Rotary: a table per layer type (base 10 000 on sliding layers; "proportional" rope over a quarter of
  the 512-wide heads, base 1 000 000, on full ones), each built for its type's head size by
  ``Gemma4TextRotaryEmbedding`` (:class:`~slide_hf.adapters.layer_rotary.LayerTypeRotaryLM`).
* Norms compute ``w * x`` in fp32 (fresh weights one, unlike Gemma 2/3's ``1 + w``); queries and keys
  are normed per head, so attention scores are not scaled (``scaling = 1``). No attention-logit cap:
  sdpa (or flash-attn) runs; ``final_logit_softcapping`` (30 in the releases) is applied by the head.
* ``layer_scalar``: every layer multiplies its output by a (1,)-shaped value that HF keeps as a
  persistent buffer (in checkpoints, never trained). It is a unit parameter here (Note [Buffers carried
  as parameters] in base.py), bound detached so that it gets no gradient and AdamW leaves it as loaded.
* Mixture of experts (``enable_moe_block``, the 26B-A4B release): beside the dense MLP every layer routes
  the pre-MLP residual to ``top_k_experts`` of ``num_experts`` experts (softmax router over a scaled,
  weightless RMSNorm, renormalised, times a learned per-expert scale); the two outputs are normed and
  added. Experts are stored fused on disk as in memory (``experts.gate_up_proj``, ``experts.down_proj``).
* Supported: the configuration of the released 31B and 26B-A4B text decoders (no per-layer input
  embeddings, no key/value sharing). Refused in one line naming the field and its value:
  ``hidden_size_per_layer_input`` > 0 (each layer would also read its slice of a second embedding table
  combined with a projection of the embeddings -- inputs the engine's hidden -> hidden chain does not
  carry), ``num_kv_shared_layers`` > 0 (later layers would attend with keys and values computed by
  earlier layers, whose gradient has no path between the engine's separately recomputed blocks) and
  ``use_bidirectional_attention="all"`` (an encoder). ``use_double_wide_mlp`` only widens key/value
  sharing layers, so without them it changes nothing and is accepted.
* Only the text model (``model_type`` ``gemma4_text``, ``Gemma4ForCausalLM``) is built; the released
  checkpoints are vision-language (``gemma4``) and are refused with the list of supported types.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4RMSNorm,
    Gemma4TextDecoderLayer,
    Gemma4TextRotaryEmbedding,
    Gemma4TextScaledWordEmbedding,
)

from slide_hf.adapters.base import BlockUnit, BufferFactory
from slide_hf.adapters.layer_rotary import LayerTypeRotaryLM
from slide_hf.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["Gemma4Adapter", "Gemma4BlockUnit", "unsupported_gemma4_fields"]

_LAYER_SCALAR = "layer_scalar"


def unsupported_gemma4_fields(config: PreTrainedConfig) -> list[str]:
    """``field=value`` for every setting of ``config`` this adapter cannot train exactly, in config order."""
    found = []
    per_layer = getattr(config, "hidden_size_per_layer_input", 0) or 0
    if per_layer > 0:
        found.append(f"hidden_size_per_layer_input={per_layer} (per-layer input embeddings)")
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if shared > 0:
        found.append(f"num_kv_shared_layers={shared} (keys and values shared across layers)")
    if getattr(config, "use_bidirectional_attention", None) == "all":
        found.append("use_bidirectional_attention='all' (an encoder, not a causal LM)")
    return found


class Gemma4BlockUnit(BlockUnit):
    """A Gemma 4 decoder layer; ``layer_scalar`` is bound detached (an HF buffer: never trained).

    The layer also takes ``shared_kv_states``, a dict where the last layer of each type leaves its keys
    and values for key/value-sharing layers; without sharing nothing reads it, so every call gets a fresh
    one and nothing outlives the call (a block recomputed in backward computes exactly its forward).
    """

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: Any) -> torch.Tensor:
        bound = dict(params)
        bound[_LAYER_SCALAR] = bound[_LAYER_SCALAR].detach()
        kwargs = {k: v for k, v in inputs.layer_kwargs(self.attention_type).items() if k in self._accepts}
        return self.call("", bound, x, shared_kv_states={}, **kwargs)


class Gemma4Adapter(LayerTypeRotaryLM):
    """``model_type == "gemma4_text"``."""

    decoder_layer = Gemma4TextDecoderLayer
    layer_rotary = Gemma4TextRotaryEmbedding

    def __init__(self, config: PreTrainedConfig) -> None:
        unsupported = unsupported_gemma4_fields(config)
        if unsupported:
            raise UserError(
                f"gemma4_text with {'; '.join(unsupported)} is not supported; the released 31B and 26B-A4B "
                "text decoders (hidden_size_per_layer_input=0, num_kv_shared_layers=0) are"
            )
        super().__init__(config)

    def make_embedding(self) -> nn.Module:
        c = self.config
        return Gemma4TextScaledWordEmbedding(
            c.vocab_size, c.hidden_size, c.pad_token_id, embed_scale=c.hidden_size**0.5
        )

    def embedding_buffers(self) -> dict[str, BufferFactory]:
        scale = self.config.hidden_size**0.5
        return {f"{self.embed_name}.embed_scale": lambda: torch.tensor(scale)}

    def make_norm(self) -> nn.Module:
        return Gemma4RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)

    def make_layer(self, index: int) -> nn.Module:
        """HF's layer with ``layer_scalar`` turned from a buffer into a parameter (Note [Buffers carried as
        parameters]), so it travels with the weights."""
        layer = super().make_layer(index)
        scalar = layer.layer_scalar
        del layer._buffers[_LAYER_SCALAR]
        layer.layer_scalar = nn.Parameter(torch.ones_like(scalar), requires_grad=False)
        return layer

    def make_block_unit(self, index: int) -> BlockUnit:
        prefix = f"{self.base_prefix}{self.layers_name}.{index}."
        unit = Gemma4BlockUnit(index, self.make_layer(index), self.attention_type(index), checkpoint_prefix=prefix)
        unit.buffer_params = frozenset({_LAYER_SCALAR})
        return unit
