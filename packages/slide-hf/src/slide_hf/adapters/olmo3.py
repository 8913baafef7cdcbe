"""OLMo 3: OLMo 2's post-norm blocks with sliding-window attention on three layers in four.

* ``config.layer_types`` says which layers slide (``sliding_window``, 4096 in the releases) and which
  attend to everything (every fourth, and always the last); each type gets its own mask.
* Rotary tables per layer type: ``rope_parameters`` has one entry per type, and the released
  long-context models scale only the full layers (YaRN, factor 8), so the two tables differ.
  :class:`~slide_hf.adapters.layer_rotary.LayerTypeRotaryLM` hands each block its type's table.
* Norms, q/k norms over all heads and the untied head are OLMo 2's (see ``olmo2.py``).
"""

from __future__ import annotations

from torch import nn
from transformers.models.olmo3.modeling_olmo3 import (
    Olmo3DecoderLayer,
    Olmo3RMSNorm,
    Olmo3RotaryEmbedding,
)

from slide_hf.adapters.layer_rotary import LayerTypeRotaryLM

__all__ = ["Olmo3Adapter"]


class Olmo3Adapter(LayerTypeRotaryLM):
    """``model_type == "olmo3"``."""

    decoder_layer = Olmo3DecoderLayer
    layer_rotary = Olmo3RotaryEmbedding

    def make_norm(self) -> nn.Module:
        return Olmo3RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
