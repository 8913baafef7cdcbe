"""Where offloaded bytes go: the units whose Adam state leaves host RAM, and the tiers that hold that state
and the offloaded activations (for `slide train` and `slide bench` alike, so a benchmark offloads exactly
what a training run would).

Every tier is chosen by name from the ``slide.tiers`` entry points (``--offload-optimizer NAME``,
``--offload-activations NAME``) and built with :meth:`slide_core.tier.Tier.for_run`, so a third-party tier
is selected like ``nvme``. ``ram`` is slide-core's registered host-RAM tier like any other name (and known
even where package metadata is missing); what it means is where the bytes already live: the Adam state
beside the fp32 master, the activations in the engine's pinned host stash, so no tier is opened for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from slide_core import plugins
from slide_core.optim.state_formats import StateArray
from slide_core.tier import Tier, TierError, TierRequest
from slide_core.tiers.host_ram import HostRamTier
from slide_hf.errors import UserError
from slide_hf.spelling import option

__all__ = [
    "IN_HOST_RAM",
    "activation_tier_class",
    "offloaded_names",
    "open_activation_tier",
    "open_tier",
    "planning_kind",
    "state_tier_capacity",
    "state_tier_class",
    "tier_class",
]

IN_HOST_RAM = HostRamTier.name
"""``ram``: the built-in tier of host RAM, where the Adam state and the activation stash already live."""


def offloaded_names(names: Sequence[str], fraction: float, elsewhere: Sequence[str]) -> tuple[str, ...]:
    """The units whose optimizer state goes to the ``--offload-optimizer`` tier, of the model's unit
    ``names`` in forward order: ``fraction`` of the units (counted in units, rounded), blocks first in
    index order, then the embedding, then the head; the units ``elsewhere`` keep theirs where their update
    runs instead (a device-resident unit's on the GPU, a GPU-streamed unit's in host RAM, which travels
    with it). The one rule the run and the plan share (``PlanInputs.offloaded_units``)."""
    ordered = [*names[1:-1], names[0], names[-1]]
    count = math.floor(fraction * len(ordered) + 0.5)
    return tuple(name for name in ordered[:count] if name not in elsewhere)


def tier_class(name: str, *, flag: str) -> type[Tier]:
    """The ``slide.tiers`` class registered as ``name`` (``ram`` is slide-core's even without metadata); what
    goes wrong is one line naming ``flag``."""
    try:
        found: type[Tier] = plugins.load("slide.tiers", name, expected=Tier)
    except plugins.PluginError as error:
        if name == IN_HOST_RAM:
            return HostRamTier
        raise UserError(f"{flag} {name}: {error}") from None
    return found


def state_tier_class(name: str) -> type[Tier] | None:
    """The tier class ``--offload-optimizer name`` selects, or None for host RAM (no tier: the state stays
    beside the master)."""
    chosen = tier_class(name, flag=option("offload_optimizer"))
    return None if chosen is HostRamTier else chosen


def activation_tier_class(name: str) -> type[Tier] | None:
    """The tier class ``--offload-activations name`` selects, or None for a tier in memory: the engine's
    pinned host stash already holds the activations there, faster than any tier could."""
    chosen = tier_class(name, flag=option("offload_activations"))
    return chosen if chosen.on_disk else None


def state_tier_capacity(arrays: Sequence[StateArray], offloaded_numels: Sequence[int]) -> int:
    """The bytes a run asks its state tier to hold (``TierRequest.capacity_bytes``): the state of every
    offloaded unit, each array as stored. The run opens its tier with it and the plan prices the tier's
    own host buffers from it, so the two ask for the same."""
    numel = sum(offloaded_numels)
    return sum(array.numel(numel) * array.dtype.itemsize for array in arrays)


def planning_kind(chosen: type[Tier] | None) -> Literal["ram", "nvme"]:
    """How the planner counts a tier's bytes: on disk (``nvme``), or in host RAM (``ram``, also for a tier
    that keeps them in memory, such as ``pinned``)."""
    return "nvme" if chosen is not None and chosen.on_disk else "ram"


def open_tier(chosen: type[Tier], request: TierRequest, *, flag: str) -> Tier:
    """``chosen`` built for this run and opened; what goes wrong is one line naming ``flag``."""
    try:
        return chosen.for_run(request).open()
    except TypeError as error:  # a tier without for_run: usable from Python only
        raise UserError(f"{flag} {chosen.name}: {error}") from None
    except (TierError, OSError, ValueError) as error:
        raise UserError(str(error).splitlines()[0]) from None


def open_activation_tier(chosen: type[Tier], directory: Path, device: Any) -> Tier:
    """Where ``--offload-activations`` puts block inputs when its tier (``chosen``, from
    :func:`activation_tier_class`) keeps them on disk: the tier the device prefers
    (``Device.preferred_activation_tier``: slide-rocm's policy tier), else a registered tier with real
    GPUDirect I/O on this machine when there is one (the inputs then go from GPU memory to disk with no host
    staging, see Note [Direct activation I/O] in slide_core/engine/activations.py), else ``chosen`` through
    pinned staging."""
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
    direct = _direct_tier() if device.is_accelerator and not _is_direct(chosen) else None
    return open_tier(direct or chosen, request, flag=option("offload_activations"))


def _is_direct(tier: type[Tier]) -> bool:
    """Whether ``tier`` moves bytes between GPU memory and disk with no host staging here."""
    probe = getattr(tier, "real_gds_available", None)
    return bool(tier.on_disk and probe is not None and probe())


def _direct_tier() -> type[Tier] | None:
    """The first registered tier with real GPUDirect I/O on this machine (a plugin that cannot load is
    passed over: it is only a faster way to the same disk)."""
    for name in plugins.available("slide.tiers"):
        try:
            candidate: type[Tier] = plugins.load("slide.tiers", name, expected=Tier)
        except plugins.PluginError:
            continue
        if _is_direct(candidate):
            return candidate
    return None
