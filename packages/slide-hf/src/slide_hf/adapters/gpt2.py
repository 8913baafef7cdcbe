"""GPT-2: learned absolute positions, Conv1D projections, LayerNorm with biases, tied head.

Differences from the Llama defaults, all wiring:

* state-dict prefix ``transformer.``, layers under ``h``, final norm ``ln_f``;
* the embedding unit owns both ``wte`` (tokens) and ``wpe`` (positions) and adds them, as
  ``GPT2Model.forward`` does; the head borrows ``wte.weight``;
* no rotary; every layer is full causal attention;
* HF's init scales the residual projections (``c_proj``) by ``1/sqrt(2 * n_layer)``.

Conv1D stores weights transposed (in, out); they are still the HF module's own parameters, so nothing
here needs to know.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from slide_core.unit import Unit
from slide_hf.adapters.base import EmbeddingUnit, HFCausalLM, HFInputs

__all__ = ["GPT2Adapter"]


class GPT2Embedding(EmbeddingUnit):
    """``wte(ids) + wpe(positions)``; GPT-2's embedding dropout is off (units run in eval mode)."""

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: HFInputs) -> torch.Tensor:
        return self.call("wte", params, x) + self.call("wpe", params, inputs.position_ids)


class GPT2Adapter(HFCausalLM):
    """``model_type == "gpt2"``."""

    decoder_layer = GPT2Block
    base_prefix = "transformer."
    layers_name = "h"
    embed_name = "wte"
    norm_name = "ln_f"

    def make_layer(self, index: int) -> nn.Module:
        return GPT2Block(self.config, layer_idx=index)

    def make_norm(self) -> nn.Module:
        return nn.LayerNorm(self.config.hidden_size, eps=self.config.layer_norm_epsilon)

    def make_embedding_unit(self) -> EmbeddingUnit:
        c = self.config
        root = nn.Module()
        root.wte = nn.Embedding(c.vocab_size, c.hidden_size)
        root.wpe = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        return GPT2Embedding(root, "wte", checkpoint_prefix=self.base_prefix)

    def init_rule(self, unit: Unit, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
        kind, value = super().init_rule(unit, name, shape)
        if name.endswith("c_proj.weight"):
            value /= math.sqrt(2 * self.config.n_layer)
        return kind, value
