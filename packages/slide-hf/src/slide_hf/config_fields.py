"""The sizes in a model directory's ``config.json``, checked before anything is built from them.

Every command that reads a model directory (`slide train`, `slide plan`, `slide export`, `slide data`) reads it
through :func:`slide_hf.load.load_config`, which calls :func:`check_config_fields` on the file's values first.
Why here and not in transformers: transformers accepts a negative or absurd hidden size and zero heads, and
what it refuses it refuses with a multi-line error that names a validator, not the file. Building the model
from such a config fails deep inside torch (a negative dimension, a division by zero), or, for a hidden size
of a billion, allocates hundreds of gigabytes to check one norm's arithmetic (adapters/fused_modules.py),
though planning loads no weights. Each refusal here is one line naming the file and the field.

The limits are far above any published model's sizes (hidden sizes in the tens of thousands, layers in the
low hundreds): a value past one is a typo or a hostile file, and the planner and the engine build and price
every layer on its own, so a million layers would take hours to plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["MAX_HEADS", "MAX_LAYERS", "MAX_VOCAB", "MAX_WIDTH", "ConfigFieldError", "check_config_fields"]

MAX_WIDTH = 1 << 18
"""Largest hidden, intermediate or head size accepted (262,144)."""

MAX_LAYERS = 1024
"""Most decoder layers accepted."""

MAX_VOCAB = 1 << 24
"""Largest vocabulary accepted (16,777,216)."""

MAX_HEADS = 1 << 16
"""Most attention heads accepted."""

_FIELDS: dict[str, int | None] = {
    "hidden_size": MAX_WIDTH,
    "n_embd": MAX_WIDTH,
    "intermediate_size": MAX_WIDTH,
    "n_inner": MAX_WIDTH,
    "head_dim": MAX_WIDTH,
    "num_hidden_layers": MAX_LAYERS,
    "n_layer": MAX_LAYERS,
    "num_attention_heads": MAX_HEADS,
    "n_head": MAX_HEADS,
    "num_key_value_heads": MAX_HEADS,
    "vocab_size": MAX_VOCAB,
    "max_position_embeddings": None,
    "n_positions": None,
}
"""Each size field (the HF names and GPT-2's), and its largest value (None: any). ``null`` is left to the
family's default (GPT-2's ``n_inner``, a ``head_dim`` derived from the hidden size)."""

_NESTED = ("text_config",)
"""Sub-configs whose sizes are the language model's (Gemma 3, Llama 4, Qwen 3.5 keep them there)."""


class ConfigFieldError(ValueError):
    """A size in ``config.json`` that no model can have; one line naming the file and the field."""


def check_config_fields(values: Mapping[str, Any], path: Path) -> None:
    """Refuse, in one :class:`ConfigFieldError` line, a size field of ``values`` (``path``'s contents) that
    is not a whole number from 1 to its limit, and heads that do not split the hidden size evenly."""
    _check(values, path, "")
    for name in _NESTED:
        nested = values.get(name)
        if isinstance(nested, Mapping):
            _check(nested, path, f"{name}.")


def _check(values: Mapping[str, Any], path: Path, prefix: str) -> None:
    for field, limit in _FIELDS.items():
        value = values.get(field)
        if value is None:
            continue
        if not _is_count(value) or value < 1 or (limit is not None and value > limit):
            bound = f"from 1 to {limit:,}" if limit is not None else "of at least 1"
            raise ConfigFieldError(f"{path}: {prefix}{field} must be a whole number {bound}, got {_shown(value)}")
    hidden = _first(values, "hidden_size", "n_embd")
    heads = _first(values, "num_attention_heads", "n_head")
    if hidden is not None and heads is not None and values.get("head_dim") is None and hidden % heads:
        raise ConfigFieldError(
            f"{path}: {prefix}num_attention_heads ({heads}) must divide {prefix}hidden_size ({hidden}) "
            "when no head_dim is given"
        )
    kv_heads = values.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ConfigFieldError(
            f"{path}: {prefix}num_key_value_heads ({kv_heads}) must divide {prefix}num_attention_heads ({heads})"
        )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first(values: Mapping[str, Any], *fields: str) -> int | None:
    for field in fields:
        if values.get(field) is not None:
            return int(values[field])
    return None


def _shown(value: Any) -> str:
    """The value as it reads in the file: a string quoted, NaN and infinities as JSON spells them."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)
