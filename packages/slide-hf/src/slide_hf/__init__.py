"""slide-hf: Hugging Face models on the SlideFormer engine.

Adapters turn an HF config into a :class:`~slide_core.unit.SlideModel` whose units run HF's own modules;
``load_weights`` / ``export_hf`` stream safetensors into and out of the fp32 host masters; presets and
``init_random`` start a run without a checkpoint.

Importing this package is cheap: transformers (seconds to import) and everything that needs it load on
first use of a name below, and nothing here imports triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "CheckpointError",
    "ModelFilesError",
    "ModelNotFoundError",
    "UnsupportedModelError",
    "build_model",
    "export_hf",
    "init_random",
    "load_config",
    "load_weights",
    "resolve_model",
    "supported_model_types",
    "train",
]

_LAZY = {
    "PRESETS": "slide_hf.presets",
    "CheckpointError": "slide_hf.load",
    "ModelFilesError": "slide_hf.load",
    "ModelNotFoundError": "slide_hf.presets",
    "UnsupportedModelError": "slide_hf.adapters",
    "build_model": "slide_hf.adapters",
    "export_hf": "slide_hf.export",
    "init_random": "slide_hf.presets",
    "load_config": "slide_hf.load",
    "load_weights": "slide_hf.load",
    "resolve_model": "slide_hf.presets",
    "supported_model_types": "slide_hf.adapters",
    "train": "slide_hf.api",
}

if TYPE_CHECKING:
    from slide_hf.adapters import UnsupportedModelError, build_model, supported_model_types
    from slide_hf.api import train
    from slide_hf.export import export_hf
    from slide_hf.load import CheckpointError, ModelFilesError, load_config, load_weights
    from slide_hf.presets import PRESETS, ModelNotFoundError, init_random, resolve_model


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'slide_hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
