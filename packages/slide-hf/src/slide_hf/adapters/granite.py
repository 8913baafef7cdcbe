"""Granite 3.x: Llama's blocks with four scalar multipliers (muP-style) from the config.

* ``embedding_multiplier`` scales the token embeddings (12 in the 3.x releases): the embedding unit
  multiplies after the lookup, as ``GraniteModel.forward`` does.
* ``residual_multiplier`` (0.22) scales each sublayer's output before the residual add and
  ``attention_multiplier`` replaces ``1 / sqrt(head_dim)`` as the score scale; both live in HF's layer.
* ``logits_scaling`` divides the logits (16). The head divides the normalised hidden state instead,
  before the LM-head matrix: the same logits up to rounding, and the fused linear + cross-entropy loss,
  which never forms the logits, still applies.
* The 3.x releases tie the head to the embedding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers.models.granite.modeling_granite import (
    GraniteDecoderLayer,
    GraniteRMSNorm,
    GraniteRotaryEmbedding,
)

from slide_hf.adapters.base import EmbeddingUnit, HeadUnit, HFCausalLM, HFInputs

__all__ = ["GraniteAdapter", "GraniteEmbedding", "GraniteHead"]


class GraniteEmbedding(EmbeddingUnit):
    """Token embeddings times ``embedding_multiplier``."""

    def __init__(self, root: nn.Module, embed_name: str, multiplier: float, **kwargs: Any) -> None:
        super().__init__(root, embed_name, **kwargs)
        self.multiplier = multiplier

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: HFInputs) -> torch.Tensor:
        return super().forward(params, x, inputs) * self.multiplier


class GraniteHead(HeadUnit):
    """The base head with logits divided by ``logits_scaling`` (applied to the hidden state)."""

    def __init__(self, *args: Any, logits_scaling: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logits_scaling = logits_scaling

    def forward_into(
        self,
        params: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        inputs: HFInputs,
        grad_into: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        hidden = self.call(self.norm_name, params, x) / self.logits_scaling
        return self.loss_of(hidden, params[self.lm_head_name], inputs, grad_into.get(self.lm_head_name))


class GraniteAdapter(HFCausalLM):
    """``model_type == "granite"``."""

    decoder_layer = GraniteDecoderLayer
    rotary_embedding = GraniteRotaryEmbedding

    def make_norm(self) -> nn.Module:
        return GraniteRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)

    def make_embedding_unit(self) -> EmbeddingUnit:
        root = nn.Module()
        root.add_module(self.embed_name, self.make_embedding())
        multiplier = float(self.config.embedding_multiplier)
        return GraniteEmbedding(root, self.embed_name, multiplier, checkpoint_prefix=self.base_prefix)

    def make_head_unit(self) -> HeadUnit:
        c = self.config
        root = nn.Module()
        root.add_module(self.norm_name, self.make_norm())
        lm_head = "lm_head.weight"
        head = GraniteHead(
            root,
            self.norm_name,
            lm_head,
            None,  # no final-logit cap in Granite
            logits_scaling=float(c.logits_scaling),
            checkpoint_prefix=self.base_prefix,
            extra_params={} if self.tied else {lm_head: ((c.vocab_size, c.hidden_size), self.lm_head_key)},
        )
        if self.tied:
            head.borrowed = {lm_head: self.token_embedding_param}
        return head
