"""Where offloaded bytes go: the units whose Adam state leaves host RAM, and the tiers that hold that state
and the offloaded activations (for `slide train` and `slide bench` alike, so a benchmark offloads exactly
what a training run would).

Tiers are chosen by name from the ``slide.tiers`` entry points (``--offload-optimizer NAME``) and built with
:meth:`slide_core.tier.Tier.for_run`, so a third-party tier is selected like ``nvme``. ``ram`` is the one
name with a meaning of its own: host RAM, where the Adam state already lives beside the fp32 master, so no
tier is opened and nothing is staged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from slide_core import plugins
from slide_core.tier import Tier, TierError, TierRequest
from slide_hf.errors import UserError
from slide_hf.spelling import option

__all__ = [
    "IN_HOST_RAM",
    "offloaded_units",
    "open_activation_tier",
    "open_tier",
    "planning_kind",
    "state_tier_class",
]

IN_HOST_RAM = "ram"
"""``--offload-optimizer ram``: the state stays in host RAM (no tier)."""


def offloaded_units(model: Any, fraction: float, resident: Sequence[str]) -> tuple[str, ...]:
    """``fraction`` of the units, blocks first in index order, then embedding and head (the planner's
    order); device-resident units keep their state on the GPU instead."""
    ordered = [*model.blocks, model.embedding, model.head]
    count = math.floor(fraction * len(ordered) + 0.5)
    return tuple(unit.name for unit in ordered[:count] if unit.name not in resident)


def state_tier_class(name: str) -> type[Tier] | None:
    """The tier class ``--offload-optimizer name`` selects, or None for ``ram`` (no tier)."""
    if name == IN_HOST_RAM:
        return None
    try:
        return plugins.load("slide.tiers", name, expected=Tier)
    except plugins.PluginError as error:
        raise UserError(f"{option('offload_optimizer', name)}: {error}") from None


def planning_kind(tier_class: type[Tier] | None) -> Literal["ram", "nvme"]:
    """How the planner counts a tier's bytes: on disk (``nvme``), or in host RAM (``ram``, also for a tier
    that keeps them in memory, such as ``pinned``)."""
    return "nvme" if tier_class is not None and tier_class.on_disk else "ram"


def open_tier(tier_class: type[Tier], request: TierRequest, *, flag: str) -> Tier:
    """``tier_class`` built for this run and opened; what goes wrong is one line naming ``flag``."""
    try:
        return tier_class.for_run(request).open()
    except TypeError as error:  # a tier without for_run: usable from Python only
        raise UserError(f"{flag} {tier_class.name}: {error}") from None
    except (TierError, OSError, ValueError) as error:
        raise UserError(str(error).splitlines()[0]) from None


def open_activation_tier(directory: Path, device: Any) -> Tier:
    """Where ``--offload-activations nvme`` puts block inputs: the tier the device prefers
    (``Device.preferred_activation_tier``: slide-rocm's policy tier), else the GDS tier when this machine
    has real GPUDirect Storage (the inputs then go from GPU memory to disk with no host staging, see Note
    [Direct activation I/O] in slide_core/engine/activations.py), else the NVMe tier through pinned staging."""
    request = TierRequest(directory=directory, device=device)
    preferred = device.preferred_activation_tier()
    if preferred is not None:
        try:
            preferred_class = plugins.load("slide.tiers", preferred, expected=Tier)
        except plugins.PluginError as error:
            raise UserError(
                f"{option('offload_activations', 'nvme')}: the {device.backend} device's policy asks for the "
                f"{preferred} tier: {error}"
            ) from None
        return open_tier(preferred_class, request, flag=option("offload_activations"))
    if device.is_accelerator:
        try:
            gds_class = plugins.load("slide.tiers", "gds", expected=Tier)
        except plugins.PluginError:
            gds_class = None
        if gds_class is not None and getattr(gds_class, "real_gds_available", lambda: False)():
            return open_tier(gds_class, request, flag=option("offload_activations"))
    try:
        nvme_class = plugins.load("slide.tiers", "nvme", expected=Tier)
    except plugins.PluginError as error:
        raise UserError(f"{option('offload_activations', 'nvme')}: {error}") from None
    return open_tier(nvme_class, request, flag=option("offload_activations"))
