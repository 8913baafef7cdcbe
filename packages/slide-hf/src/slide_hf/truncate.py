"""A model configuration cut to its first ``n`` decoder layers, for measuring what does not fit whole.

Why: the mixture-of-experts presets (Llama 4 Scout, Qwen3-Next, Qwen3.5-MoE, Moonlight) need several
hundred GiB of host RAM for their fp32 master and Adam state, more than most benchmark hosts have. Their
first ``n`` layers keep every shape that sets the speed of one layer (hidden size, heads, experts, the
layer-type pattern, the vocabulary of the embedding and the head), so a run of the cut model measures
the per-layer times the full model would have; the result says it is cut and to how many layers.

Per-layer fields are cut with the layers: lists with one entry per layer (``layer_types``,
``no_rope_layers``) keep their first ``n`` entries, and lists of layer indices (``moe_layers``,
``mlp_only_layers``) keep the indices below ``n``. Counts of the model's *last* layers
(``num_kv_shared_layers``: Gemma 4's layers that reuse an earlier layer's keys and values) keep the
ones among the first ``n``: cutting E2B's 35 layers, the last 20 shared, to 22 leaves layers 15-21 shared.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["truncate_layers"]

LAYER_INDEX_FIELDS = ("moe_layers", "mlp_only_layers")
"""Config fields that list layer indices rather than one value per layer."""

TRAILING_COUNT_FIELDS = ("num_kv_shared_layers",)
"""Config fields that count the model's last layers."""


def truncate_layers(config: Any, layers: int) -> Any:
    """A copy of ``config`` with its first ``layers`` decoder layers; ``ValueError`` names a bad count."""
    total = int(config.num_hidden_layers)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= total:
        raise ValueError(f"--layers must be a whole number from 1 to {total} (the model's layers), got {layers!r}")
    cut = copy.deepcopy(config)
    for field, value in vars(config).items():
        if not isinstance(value, list):
            continue
        if field in LAYER_INDEX_FIELDS:
            setattr(cut, field, [index for index in value if index < layers])
        elif len(value) == total:
            setattr(cut, field, value[:layers])
    for field in TRAILING_COUNT_FIELDS:
        count = getattr(config, field, None)
        if isinstance(count, int) and not isinstance(count, bool):
            setattr(cut, field, max(0, count - (total - layers)))
    cut.num_hidden_layers = layers
    return cut
