"""The options the engine reads, as :class:`~slide_hf.setup.RunOptions` takes them: generated from the
declarations.

`slide train` and `slide bench` set up the same engine (slide_hf/setup.py) from a :class:`TrainConfig`.
Which of its options the engine reads, under which name and converted how (``--gpu-memory 24GiB`` as
``gpu_memory_bytes``, ``--dtype bfloat16`` as ``torch.bfloat16``), is part of each option's declaration
(``engine=`` in slide_hf/options/config.py); :func:`engine_values` walks those declarations, so an option
the engine needs is declared once and reaches both commands without either copying it by hand.
"""

from __future__ import annotations

from typing import Any

from slide_hf.options.config import TrainConfig, train_options
from slide_hf.options.schema import Declared

__all__ = ["engine_options", "engine_values"]


def engine_options() -> tuple[Declared, ...]:
    """The declared options the engine reads, in declaration order."""
    return tuple(item for item in train_options() if item.engine_name is not None)


def engine_values(cfg: TrainConfig) -> dict[str, Any]:
    """``cfg``'s options the engine reads, by the engine's names, converted as their declarations say."""
    values: dict[str, Any] = {}
    for item in engine_options():
        assert item.engine_name is not None  # engine_options() keeps only those
        values[item.engine_name] = item.engine_value(getattr(cfg, item.name))
    return values
