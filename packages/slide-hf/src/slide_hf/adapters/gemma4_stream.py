"""What Gemma 4's units pass each other besides the hidden state: the activation the engine slides, widened.

Note [Gemma 4's widened stream]: the engine runs a chain embedding -> blocks -> head, one activation
tensor from each unit to the next, and recomputes each block alone in backward from its stashed input,
taking the gradient of that one tensor. Two Gemma 4 features make a layer read more than the hidden
state, and both become exact by carrying the extra values in the same tensor, after the hidden state
along the last dimension:

* Per-layer input embeddings (``hidden_size_per_layer_input`` = P > 0): layer ``i`` reads
  ``(norm(W_i e / sqrt(H)) + T_i[ids] sqrt(P)) / sqrt(2)``, where ``e`` is the embedding output, ``W_i``
  and ``T_i`` are layer ``i``'s rows of the projection and columns of the per-layer table, and ``norm``
  is one RMSNorm whose weight all layers share. Each block holds its ``W_i`` and ``T_i`` (an exact
  re-partition of HF's two tensors: ``CheckpointSlice.source``), reads ``e`` and the shared norm weight
  (broadcast over the tokens by the embedding unit, which owns it) from the stream, and passes them on
  unchanged. Their gradients flow back down the stream, summed over the blocks, into the embedding
  unit: the same sums HF's autograd makes.
* Key/value sharing (``num_kv_shared_layers`` > 0): the last layers attend with the keys and values
  that the last earlier layer of their type computed. That donor layer writes them (normed, rotated)
  into its type's slot of the stream; every sharing layer reads them there; gradients from all sharing
  layers reach the donor's projections down the stream.

Layout, width ``H [+ H + P] [+ sum over shared types of 2 kv_heads head_dim]``: ``[hidden | embeddings |
norm weight | keys, values of each shared type]``. The head reads the hidden part only. The cost is
activation memory: the stash of every block input and the transfers grow by the width over ``H``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4RMSNorm,
    Gemma4TextModel,
    Gemma4TextScaledWordEmbedding,
)

__all__ = ["KVSlot", "LayerInput", "Stream", "layer_input_params"]


@dataclass(frozen=True)
class KVSlot:
    """Where one layer type's shared keys and values sit in the stream (``offset``: the keys'; the values
    follow), with their ``(kv_heads, head_dim)``."""

    offset: int
    kv_heads: int
    head_dim: int

    @property
    def width(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Stream:
    """The layout of Note [Gemma 4's widened stream]."""

    hidden: int
    per_layer: int = 0
    kv: Mapping[str, KVSlot] = field(default_factory=dict)

    @property
    def width(self) -> int:
        base = self.hidden + (self.hidden + self.per_layer if self.per_layer else 0)
        return base + sum(2 * slot.width for slot in self.kv.values())

    @property
    def widened(self) -> bool:
        return self.width > self.hidden

    def hidden_state(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden state: the stream's first ``hidden`` elements (all of it when not widened)."""
        return x[..., : self.hidden] if self.widened else x

    def embeddings(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.hidden : 2 * self.hidden]

    def norm_weight(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., 2 * self.hidden : 2 * self.hidden + self.per_layer]

    def start(self, embeds: torch.Tensor, norm_weight: torch.Tensor | None) -> torch.Tensor:
        """The embedding unit's output: the embeddings as the hidden state (and again, with the shared norm
        weight, for the per-layer inputs), and zeros where the donors will write keys and values."""
        parts = [embeds]
        if self.per_layer:
            assert norm_weight is not None
            parts += [embeds, norm_weight.to(embeds.dtype).expand(*embeds.shape[:-1], self.per_layer)]
        kv_width = sum(2 * slot.width for slot in self.kv.values())
        if kv_width:
            parts.append(embeds.new_zeros(*embeds.shape[:-1], kv_width))
        return torch.cat(parts, dim=-1) if len(parts) > 1 else embeds

    def read_kv(self, x: torch.Tensor, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``layer_type`` as HF's attention holds them: (batch, kv_heads, seq, head_dim)."""
        slot = self.kv[layer_type]
        keys = x[..., slot.offset : slot.offset + slot.width]
        values = x[..., slot.offset + slot.width : slot.offset + 2 * slot.width]
        shape = (slot.kv_heads, slot.head_dim)
        return keys.unflatten(-1, shape).transpose(1, 2), values.unflatten(-1, shape).transpose(1, 2)

    def write_kv(self, x: torch.Tensor, layer_type: str, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x`` with ``layer_type``'s slot replaced by ``kv`` (as :meth:`read_kv` returns them)."""
        slot = self.kv[layer_type]
        keys, values = (t.transpose(1, 2).flatten(-2) for t in kv)
        end = slot.offset + 2 * slot.width
        return torch.cat((x[..., : slot.offset], keys, values, x[..., end:]), dim=-1)


class LayerInput(nn.Module):
    """One layer's per-layer input, computed by HF's own ``get_per_layer_inputs`` and
    ``project_per_layer_inputs`` on this layer's slices (the functions see a model of one layer).

    ``per_layer_projection_norm.weight`` is not this module's to own: it is bound, per call, to the
    shared weight read from the stream (Note [Gemma 4's widened stream]).
    """

    def __init__(self, vocab: int, hidden: int, per_layer: int, padding_idx: int | None, eps: float) -> None:
        super().__init__()
        self.embed_tokens_per_layer = Gemma4TextScaledWordEmbedding(
            vocab,
            per_layer,
            padding_idx,  # type: ignore[arg-type]  # HF annotates int; nn.Embedding takes None (no padding row)
            embed_scale=per_layer**0.5,
        )
        self.per_layer_model_projection = nn.Linear(hidden, per_layer, bias=False)
        self.per_layer_projection_norm = Gemma4RMSNorm(per_layer, eps=eps)
        # What HF's two methods read from their model, for a model of one layer.
        self.config = _OneLayer()
        self.hidden_size_per_layer_input = per_layer
        self.per_layer_model_projection_scale = hidden**-0.5
        self.per_layer_input_scale = 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        tokens = Gemma4TextModel.get_per_layer_inputs(self, input_ids, embeds)  # type: ignore[arg-type]
        combined = Gemma4TextModel.project_per_layer_inputs(self, embeds, tokens)  # type: ignore[arg-type]
        return combined[..., 0, :]


@dataclass(frozen=True)
class _OneLayer:
    num_hidden_layers: int = 1


def layer_input_params(
    params: Mapping[str, torch.Tensor], names: tuple[str, ...], norm_weight: torch.Tensor, scale: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The tensors to bind into a :class:`LayerInput`: the block's two slices (``names``, named as the
    module's own), the stream's norm weight (one per token: a layer axis is inserted for HF's (batch, seq,
    layers, width) layout) and the embedding scale buffer."""
    bound = {name: params[name] for name in names}
    bound["per_layer_projection_norm.weight"] = norm_weight.unsqueeze(-2)
    bound["embed_tokens_per_layer.embed_scale"] = scale
    return bound
