"""Model adapters: a Hugging Face config in, a :class:`~slide_core.unit.SlideModel` out.

Families register under the ``slide.adapters`` entry-point group keyed by HF ``model_type`` (see
``packages/slide-hf/pyproject.toml``), so a third-party package can add one without touching this code.
This module stays import-light: an adapter module (and transformers' modeling code) is imported only
when a model of its type is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slide_core import plugins
from slide_core.unit import SlideModel
from slide_hf.adapters.attention import attention_summary

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["GROUP", "UnsupportedModelError", "attention_summary", "build_model", "supported_model_types"]

GROUP = "slide.adapters"


class UnsupportedModelError(ValueError):
    """No adapter for this architecture (an encoder, or a decoder family nobody has written yet)."""


def supported_model_types() -> list[str]:
    """HF ``model_type`` values with a registered adapter, sorted."""
    return plugins.available(GROUP)


def build_model(config: PreTrainedConfig) -> SlideModel:
    """The :class:`SlideModel` for ``config``, through the adapter registered for ``config.model_type``.

    Raises :class:`UnsupportedModelError` (one line, listing what is supported) when there is none.
    """
    model_type = getattr(config, "model_type", None) or "<none>"
    supported = supported_model_types()
    if model_type not in supported:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "unknown architecture"
        raise UnsupportedModelError(
            f"model_type {model_type!r} ({archs}) is not a supported causal LM; "
            f"supported model types: {', '.join(supported) or 'none installed'}"
        )
    adapter = plugins.load(GROUP, model_type, expected=SlideModel)
    return adapter(config)
