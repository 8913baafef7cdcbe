"""One fp32 array of the whole model (the master, or an optimizer state), read for a checkpoint from
wherever each unit keeps it.

A host-updated unit's master and state are in the host slabs, a device-resident unit's on the GPU, an
offloaded unit's state on a storage tier. Gathering all of it in the host slabs before a save
(``drain(with_state=True)``) touches 12 bytes of host memory per resident parameter (4 for the master,
whose pages the engine gave back, see Note [Resident host copies]) and 8 per offloaded one, which a run
that moved them off the host precisely for lack of RAM may not have: qwen2.5-14b on a whole H200 would
need 31 GiB more for its resident masters alone. :class:`StateSource` instead lets the checkpoint
writer pull the file's bytes block by block (:class:`~slide_core.checkpoint.ArraySource`): a block
copies host ranges, device ranges and one offloaded unit at a time, in the slabs' element order, so the
file is the same as one written from gathered slabs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from slide_core.unit import Unit

from .resident import ResidentUnit
from .state_offload import OffloadedState

__all__ = ["StateSource"]


class StateSource:
    """Array ``name`` over ``units`` in slab order (an ``ArraySource`` for ``save_checkpoint``):
    ``"master"``, or an optimizer state name."""

    def __init__(
        self,
        name: str,
        units: Sequence[Unit],
        host_views: Mapping[str, torch.Tensor],
        residents: Mapping[str, ResidentUnit],
        offloaded: OffloadedState | None,
    ) -> None:
        if name == "master":
            offloaded = None  # offloading moves optimizer state only
        self.name = name
        self.dtype = torch.float32
        self._units = list(units)
        self._host = host_views  # unit -> this state's flat host view (valid for host-updated units)
        self._residents = residents
        self._offloaded = offloaded
        self._starts = []
        total = 0
        for unit in self._units:
            self._starts.append(total)
            total += unit.layout.numel
        self.numel = total
        self._staged: tuple[str, torch.Tensor] | None = None  # the last offloaded unit read, this state

    def _unit_state(self, unit: Unit) -> torch.Tensor:
        """The unit's flat state ``name``: a device tensor, a staged copy from the tier, or the host view."""
        resident = self._residents.get(unit.name)
        if resident is not None:
            return resident.master if self.name == "master" else resident.state[self.name]
        if self._offloaded is not None and unit.name in self._offloaded.units:
            if self._staged is None or self._staged[0] != unit.name:
                self._staged = None  # release the previous unit's copy first
                staged = {
                    key: torch.empty(unit.layout.numel, dtype=torch.float32) for key in self._offloaded.state_names
                }
                self._offloaded.copy_to(unit.name, staged)
                self._staged = (unit.name, staged[self.name])
            return self._staged[1]
        return self._host[unit.name]

    def read_into(self, start: int, out: torch.Tensor) -> None:
        end = start + out.numel()
        for unit, unit_start in zip(self._units, self._starts, strict=True):
            unit_end = unit_start + unit.layout.numel
            lo, hi = max(start, unit_start), min(end, unit_end)
            if lo >= hi:
                continue
            source = self._unit_state(unit)
            out[lo - start : hi - start].copy_(source[lo - unit_start : hi - unit_start])
