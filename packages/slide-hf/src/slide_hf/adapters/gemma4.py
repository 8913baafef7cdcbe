"""Gemma 4 (text): sliding and full layers of different shapes, q/k/v norms, sandwich norms, a scaled
embedding, a capped head, an optional mixture of experts beside the dense MLP, and -- in the small
releases -- per-layer input embeddings and keys and values shared across layers.

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
* Per-layer input embeddings (``hidden_size_per_layer_input`` > 0, the E2B and E4B releases) and key/
  value sharing (``num_kv_shared_layers`` > 0, the same releases; ``use_double_wide_mlp`` widens the
  sharing layers' MLPs) make a layer read more than the hidden state; the units pass those values along
  with it (Note [Gemma 4's widened stream] in gemma4_stream.py). Each block holds its rows of
  ``per_layer_model_projection`` and its columns of ``embed_tokens_per_layer``; the loader reads and the
  exporter writes them back as HF's two tensors.
* Refused in one line naming the field and its value: ``use_bidirectional_attention="all"`` (an
  encoder), and key/value sharing where a sharing layer's type has no earlier layer to take keys and
  values from (transformers would fail on the first forward).
* Only the text model (``model_type`` ``gemma4_text``, ``Gemma4ForCausalLM``) is built; the released
  checkpoints are vision-language (``gemma4``) and are refused with the list of supported types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.func import functional_call
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4RMSNorm,
    Gemma4TextDecoderLayer,
    Gemma4TextRotaryEmbedding,
    Gemma4TextScaledWordEmbedding,
)

from slide_hf.adapters.base import BlockUnit, BufferFactory, CheckpointSlice, EmbeddingUnit, HeadUnit
from slide_hf.adapters.gemma4_stream import KVSlot, LayerInput, Stream, layer_input_params
from slide_hf.adapters.layer_rotary import LayerTypeInputs, LayerTypeRotaryLM
from slide_hf.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["Gemma4Adapter", "Gemma4BlockUnit", "Gemma4Inputs"]

_LAYER_SCALAR = "layer_scalar"
_PROJECTION_NORM = "per_layer_projection_norm"
_LAYER_INPUT_PARAMS = ("embed_tokens_per_layer.weight", "per_layer_model_projection.weight")
"""A block's slices of HF's two per-layer input tensors, named as in HF and in :class:`LayerInput`."""


@dataclass
class Gemma4Inputs(LayerTypeInputs):
    """:class:`LayerTypeInputs` and the token ids, from which each block looks up its per-layer input."""

    input_ids: torch.Tensor | None = None


class Gemma4EmbeddingUnit(EmbeddingUnit):
    """Token ids -> the stream (Note [Gemma 4's widened stream]); owns the per-layer inputs' shared norm."""

    def __init__(self, root: nn.Module, embed_name: str, stream: Stream, **kwargs: Any) -> None:
        super().__init__(root, embed_name, **kwargs)
        self.stream = stream

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: Any) -> torch.Tensor:
        embeds = self.call(self.embed_name, params, x)
        return self.stream.start(embeds, params.get(f"{_PROJECTION_NORM}.weight"))


class Gemma4BlockUnit(BlockUnit):
    """A Gemma 4 decoder layer on the stream.

    ``layer_scalar`` is bound detached (an HF buffer: never trained). The layer takes
    ``shared_kv_states``, the dict where a donor layer leaves its keys and values and a sharing layer
    finds them; every call gets a fresh one filled from the stream, so nothing outlives the call and a
    block recomputed in backward computes exactly its forward.
    """

    def __init__(
        self,
        index: int,
        layer: nn.Module,
        attention_type: str,
        stream: Stream,
        *,
        layer_input: LayerInput | None,
        kv_role: str | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(index, layer, attention_type, **kwargs)
        self.stream = stream
        self.layer_input = layer_input
        self.kv_role = kv_role
        """``"writes"`` (the donor of its type), ``"reads"`` (a sharing layer) or None."""
        self._scale: dict[torch.device, torch.Tensor] = {}

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: Any) -> torch.Tensor:
        stream = self.stream
        layer_params = {n: t for n, t in params.items() if n not in _LAYER_INPUT_PARAMS}
        layer_params[_LAYER_SCALAR] = layer_params[_LAYER_SCALAR].detach()
        kwargs = {k: v for k, v in inputs.layer_kwargs(self.attention_type).items() if k in self._accepts}
        shared: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.kv_role == "reads":
            shared[self.attention_type] = stream.read_kv(x, self.attention_type)
        if self.layer_input is not None:
            kwargs["per_layer_input"] = self._per_layer_input(params, x, inputs.input_ids)
        out = self.call("", layer_params, stream.hidden_state(x), shared_kv_states=shared, **kwargs)
        if not stream.widened:
            return out
        if self.kv_role == "writes":
            x = stream.write_kv(x, self.attention_type, shared[self.attention_type])
        return torch.cat((out, x[..., stream.hidden :]), dim=-1)

    def _per_layer_input(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert self.layer_input is not None
        scale = self._scale.get(x.device)
        if scale is None:
            scale = self._scale[x.device] = torch.tensor(float(self.stream.per_layer) ** 0.5, device=x.device)
        bound = layer_input_params(params, _LAYER_INPUT_PARAMS, self.stream.norm_weight(x), scale)
        return functional_call(self.layer_input, bound, (ids, self.stream.embeddings(x)))


class Gemma4HeadUnit(HeadUnit):
    """The base head on the hidden part of the stream."""

    def __init__(self, *args: Any, stream: Stream, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream = stream

    def forward_into(
        self,
        params: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        inputs: Any,
        grad_into: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        return super().forward_into(params, self.stream.hidden_state(x), inputs, grad_into)


class Gemma4Adapter(LayerTypeRotaryLM):
    """``model_type == "gemma4_text"``."""

    decoder_layer = Gemma4TextDecoderLayer
    layer_rotary = Gemma4TextRotaryEmbedding

    def __init__(self, config: PreTrainedConfig) -> None:
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise UserError(
                "gemma4_text with use_bidirectional_attention='all' attends both ways (an encoder), not a "
                "causal LM; set it to null to fine-tune the causal model"
            )
        self.kv_roles = _kv_roles(config)
        self.stream = _stream(config, self.kv_roles)
        super().__init__(config)

    def activation_width(self) -> int | None:
        """The widened stream's width (Note [Gemma 4's widened stream]); None for the large releases,
        whose stream is the hidden state alone."""
        return self.stream.width if self.stream.widened else None

    # ---- units ---------------------------------------------------------------------------------------
    def make_embedding(self) -> nn.Module:
        c = self.config
        return Gemma4TextScaledWordEmbedding(
            c.vocab_size, c.hidden_size, c.pad_token_id, embed_scale=c.hidden_size**0.5
        )

    def embedding_buffers(self) -> dict[str, BufferFactory]:
        scale = self.config.hidden_size**0.5
        return {f"{self.embed_name}.embed_scale": lambda: torch.tensor(scale)}

    def make_embedding_unit(self) -> EmbeddingUnit:
        root = nn.Module()
        root.add_module(self.embed_name, self.make_embedding())
        if self.stream.per_layer:
            root.add_module(_PROJECTION_NORM, Gemma4RMSNorm(self.stream.per_layer, eps=self.config.rms_norm_eps))
        return Gemma4EmbeddingUnit(
            root, self.embed_name, self.stream, checkpoint_prefix=self.base_prefix, buffers=self.embedding_buffers()
        )

    def make_norm(self) -> nn.Module:
        return Gemma4RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)

    def make_layer(self, index: int) -> nn.Module:
        """HF's layer with ``layer_scalar`` turned from a buffer into a parameter (Note [Buffers carried as
        parameters]), so it travels with the weights."""
        layer = super().make_layer(index)
        scalar = cast(torch.Tensor, layer.layer_scalar)  # a buffer, until the next line
        del layer._buffers[_LAYER_SCALAR]
        layer.layer_scalar = nn.Parameter(torch.ones_like(scalar), requires_grad=False)
        return layer

    def make_block_unit(self, index: int) -> BlockUnit:
        c, width = self.config, self.stream.per_layer
        prefix = f"{self.base_prefix}{self.layers_name}.{index}."
        layer_input, extra, slices = None, {}, {}
        if width:
            layer_input = LayerInput(c.vocab_size_per_layer_input, c.hidden_size, width, c.pad_token_id, c.rms_norm_eps)
            layers, part = c.num_hidden_layers, slice(index * width, (index + 1) * width)
            table, projection = _LAYER_INPUT_PARAMS
            pieces = {
                table: ((c.vocab_size_per_layer_input, layers * width), (slice(None), part)),
                projection: ((layers * width, c.hidden_size), (part,)),
            }
            for name, (stored_shape, source) in pieces.items():
                key = f"{self.base_prefix}{name}"
                shape = tuple(torch.empty(stored_shape, device="meta")[source].shape)
                extra[name] = (shape, key)
                slices[name] = (CheckpointSlice(key, (), source, stored_shape),)
        unit = Gemma4BlockUnit(
            index,
            self.make_layer(index),
            self.attention_type(index),
            self.stream,
            layer_input=layer_input,
            kv_role=self.kv_roles.get(index),
            checkpoint_prefix=prefix,
            extra_params=extra,
        )
        unit.checkpoint_slices.update(slices)
        unit.buffer_params = frozenset({_LAYER_SCALAR})
        return unit

    def make_head_unit(self) -> HeadUnit:
        """The base class's head (final norm, the tied or own matrix, the final cap) on the stream."""
        return self.build_head_unit(Gemma4HeadUnit, stream=self.stream)

    # ---- side inputs ---------------------------------------------------------------------------------
    def prepare_inputs(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        dtype: torch.dtype,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> Gemma4Inputs:
        inputs = super().prepare_inputs(input_ids, labels, dtype, position_ids=position_ids)
        return Gemma4Inputs(
            inputs.position_ids,
            inputs.position_embeddings,
            inputs.masks,
            inputs.shift_labels,
            inputs.rotary_by_type,
            input_ids,
        )


def _kv_roles(config: PreTrainedConfig) -> dict[int, str]:
    """Layer index -> ``"writes"`` (the last layer of its type before the sharing ones, as HF's
    ``store_full_length_kv`` picks it, for the types the sharing layers have) or ``"reads"``."""
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if shared <= 0:
        return {}
    layers = int(config.num_hidden_layers)
    types = list(config.layer_types)
    first = layers - shared
    if first <= 0:
        raise UserError(
            f"gemma4_text with num_kv_shared_layers={shared} and num_hidden_layers={layers} leaves no layer to "
            "compute the keys and values the others share; use fewer shared layers"
        )
    roles = dict.fromkeys(range(first, layers), "reads")
    for kind in dict.fromkeys(types[first:]):
        donors = [i for i in range(first) if types[i] == kind]
        if not donors:
            raise UserError(
                f"gemma4_text with num_kv_shared_layers={shared}: the shared {kind} layers have no earlier "
                f"{kind} layer to take keys and values from (layer_types={types})"
            )
        roles[donors[-1]] = "writes"
    return roles


def _stream(config: PreTrainedConfig, kv_roles: Mapping[int, str]) -> Stream:
    """The layout of Note [Gemma 4's widened stream] for ``config``."""
    hidden = int(config.hidden_size)
    per_layer = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
    offset = hidden + (hidden + per_layer if per_layer else 0)
    slots = {}
    for index, role in sorted(kv_roles.items()):
        if role != "writes":
            continue
        layer = config.per_layer_config[index]
        slot = KVSlot(offset, int(layer.num_key_value_heads), int(layer.head_dim))
        slots[config.layer_types[index]] = slot
        offset += 2 * slot.width
    return Stream(hidden, per_layer, slots)
