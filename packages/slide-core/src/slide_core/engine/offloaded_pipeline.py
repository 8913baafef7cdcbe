"""Tier-offloaded units: updated on the host optimizer thread like host-updated ones (host_pipeline.py),
with their optimizer state on a storage tier (NVMe) staged through host buffers around each update
(state_offload.py). The master stays in host RAM: offloading moves the optimizer state only.

While one unit is updated the next one's state is read ahead: the next in backward order as gradients
land, the next in forward order for a deferred step's held updates (Note [Deferred clipped steps] in
docs/design/engine.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from slide_core.unit import Unit

from .host_pipeline import HostPipeline, ReadAhead
from .host_state import HostState
from .state_offload import OffloadedState

__all__ = ["OffloadedPipeline"]


class OffloadedPipeline(HostPipeline):
    """Host updates of ``units`` (model order), with their optimizer state in ``offloaded``."""

    def __init__(self, units: Sequence[Unit], offloaded: OffloadedState, **host: Any) -> None:
        super().__init__(**host)
        self.offloaded = offloaded
        order = [unit.name for unit in units]
        self._next = {"backward": dict(itertools.pairwise(reversed(order))), "forward": dict(itertools.pairwise(order))}
        for name in order:
            if self.host_state.valid[name]:  # state loaded into the host slabs before the engine started
                offloaded.load_from(name, self.host_state.views(name))

    def _state(self, unit: Unit) -> dict[str, torch.Tensor]:
        return self.offloaded.acquire(unit.name)

    def _release_state(self, unit: Unit, read_ahead: ReadAhead) -> None:
        """Write the unit's state back and read ahead the next one's (Note [Staging reuse ordering])."""
        self.offloaded.release(unit.name)
        following = self._next[read_ahead].get(unit.name) if read_ahead is not None else None
        if following is not None:
            self.offloaded.prefetch(following)

    def state_array(self, unit: Unit, name: str) -> torch.Tensor:
        if name == "master":
            return super().state_array(unit, name)
        staged = self.offloaded.staged(unit.name, name)
        self.offloaded.read(unit.name, name, staged)
        return staged

    def restore_target(self, unit: Unit, name: str) -> torch.Tensor:
        if name == "master":
            return super().restore_target(unit, name)
        return self.offloaded.staged(unit.name, name)  # gathered whole, then written to the tier

    def restored(self, unit: Unit, name: str, values: torch.Tensor) -> None:
        if name != "master":
            self.offloaded.load_state(unit.name, name, values)

    def sync_to_host(self, host_state: HostState | None) -> None:
        if host_state is not None:
            for name in self.offloaded.units:
                self.offloaded.copy_to(name, host_state.views(name))

    def flush(self) -> None:
        self.offloaded.flush()
