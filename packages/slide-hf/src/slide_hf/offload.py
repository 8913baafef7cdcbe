"""Which units keep their Adam state on NVMe, and the tiers that hold it and the offloaded activations
(for `slide train` and `slide bench` alike, so a benchmark offloads exactly what a training run would)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slide_hf.errors import UserError

__all__ = ["offloaded_units", "open_activation_tier", "open_nvme_tier"]


def offloaded_units(model: Any, fraction: float, resident: Sequence[str]) -> tuple[str, ...]:
    """``fraction`` of the units, blocks first in index order, then embedding and head (the planner's
    order); device-resident units keep their state on the GPU instead."""
    ordered = [*model.blocks, model.embedding, model.head]
    count = math.floor(fraction * len(ordered) + 0.5)
    return tuple(unit.name for unit in ordered[:count] if unit.name not in resident)


def open_activation_tier(directory: Path, device: Any) -> Any:
    """Where ``--offload-activations nvme`` puts block inputs: the GDS tier when this machine has real
    GPUDirect Storage (the inputs then go from GPU memory to disk with no host staging, see Note [Direct
    activation I/O] in slide_core/engine/activations.py), else the NVMe tier through pinned staging."""
    from slide_core import plugins

    if device.is_accelerator:
        try:
            gds_class = plugins.load("slide.tiers", "gds")
        except plugins.PluginError:
            gds_class = None
        if gds_class is not None and getattr(gds_class, "real_gds_available", lambda: False)():
            return _open(gds_class, directory)
    return open_nvme_tier(directory)


def open_nvme_tier(directory: Path) -> Any:
    """An NVMe tier from slide-io (an entry point), opened on ``directory`` (its own files inside)."""
    from slide_core import plugins

    try:
        tier_class = plugins.load("slide.tiers", "nvme")
    except plugins.PluginError as error:
        raise UserError(f"NVMe offload needs slide-io: pip install slide-io ({error})") from None
    return _open(tier_class, directory)


def _open(tier_class: Any, directory: Path) -> Any:
    from slide_core.tier import TierError

    try:
        return tier_class(directory).open()
    except (TierError, OSError, ValueError) as error:
        raise UserError(str(error).splitlines()[0]) from None
