"""The run's data sources as one tuple, whichever way ``--data`` was given: a leaf the option rules and the
config both read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["data_sources"]


def data_sources(cfg: Any) -> tuple[Path, ...]:
    """The run's ``--data`` sources (empty for the bundled text)."""
    data = cfg.data
    return data if isinstance(data, tuple) else () if data is None else (data,)
