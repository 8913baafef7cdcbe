"""Rotary tables per attention layer type, for families whose layer types rotate differently.

Gemma 3 rotates its sliding layers with base 10 000 and its full layers with base 1 000 000 (and may
scale only the full ones); OLMo 3 keeps one ``rope_parameters`` entry per layer type. HF builds one
rotary module that answers ``rotary(x, position_ids, layer_type)`` and hands each decoder layer the
table of its own type. :class:`LayerTypeRotaryLM` does the same with the base class's side inputs:
one ``(cos, sin)`` per layer type in :class:`LayerTypeInputs`, and each block receives its type's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from slide_hf.adapters.base import HFCausalLM, HFInputs

__all__ = ["LayerTypeInputs", "LayerTypeRotaryLM"]


@dataclass
class LayerTypeInputs(HFInputs):
    """:class:`HFInputs` with one rotary table per layer type (``position_embeddings`` is unused)."""

    rotary_by_type: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=dict)

    def layer_kwargs(self, attention_type: str) -> dict[str, Any]:
        kwargs = super().layer_kwargs(attention_type)
        kwargs["position_embeddings"] = self.rotary_by_type[attention_type]
        return kwargs


class LayerTypeRotaryLM(HFCausalLM):
    """A family whose HF rotary module takes the layer type (``forward(x, position_ids, layer_type)``).

    ``layer_rotary`` names that class; the base class's single-table ``rotary_embedding`` stays unset.
    Only the layer types the model's blocks have are computed, as HF's model does.
    """

    layer_rotary: ClassVar[type[nn.Module]]

    def prepare_inputs(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        dtype: torch.dtype,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> LayerTypeInputs:
        inputs = super().prepare_inputs(input_ids, labels, dtype, position_ids=position_ids)
        # Like the base class: the rotary module reads only the probe's dtype and device.
        probe = torch.empty((*input_ids.shape, 0), dtype=dtype, device=input_ids.device)
        rotary = self._layer_rotary_on(input_ids.device)
        tables = {t: self.rotary_table(rotary, probe, inputs.position_ids, t) for t in self.rotary_layer_types()}
        return LayerTypeInputs(inputs.position_ids, None, inputs.masks, inputs.shift_labels, tables)

    def rotary_layer_types(self) -> list[str]:
        """The layer types of this model's blocks, in model order."""
        return list(dict.fromkeys(b.attention_type for b in self.blocks))

    def rotary_table(
        self, rotary: nn.Module, probe: torch.Tensor, position_ids: torch.Tensor, layer_type: str
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(cos, sin)`` for ``layer_type``; a family may return None for a type that does not rotate."""
        return rotary(probe, position_ids, layer_type)

    def _layer_rotary_on(self, device: torch.device) -> nn.Module:
        rotary = self._rotary.get(device)
        if rotary is None:
            with torch.device(device):
                rotary = self.layer_rotary(self.config)
            self._rotary[device] = rotary
        return rotary

    def extra_tensors_bytes(self) -> int:
        """The rotary module's buffers (fp32 inverse frequencies per layer type, and their copies)."""
        with torch.device("meta"):
            rotary = self.layer_rotary(self.config)
        return sum(b.numel() * b.element_size() for b in rotary.buffers())
