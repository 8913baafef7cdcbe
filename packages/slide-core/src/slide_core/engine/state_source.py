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
file is the same as one written from gathered slabs. :class:`StateSink` is the mirror for a resume.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from slide_core.unit import Unit

from .resident import ResidentUnit
from .state_offload import OffloadedState

__all__ = ["StateSink", "StateSource"]


class _PlacedArray:
    """Array ``name`` over ``units`` in slab order, each unit's range kept where the unit keeps it."""

    def __init__(
        self,
        name: str,
        units: Sequence[Unit],
        host_views: Mapping[str, torch.Tensor],
        residents: Mapping[str, ResidentUnit],
        offloaded: OffloadedState | None,
    ) -> None:
        self.name = name
        self.dtype = torch.float32
        self._units = list(units)
        self._host = host_views  # unit -> this array's flat host view (valid for host-updated units)
        self._residents = residents
        self._offloaded = None if name == "master" else offloaded  # offloading moves optimizer state only
        self._starts = []
        total = 0
        for unit in self._units:
            self._starts.append(total)
            total += unit.layout.numel
        self.numel = total

    def _pieces(self, start: int, count: int) -> Iterator[tuple[Unit, slice, slice]]:
        """The units overlapping ``[start, start + count)``: (unit, range in the unit, range in the block)."""
        end = start + count
        for unit, unit_start in zip(self._units, self._starts, strict=True):
            lo, hi = max(start, unit_start), min(end, unit_start + unit.layout.numel)
            if lo < hi:
                yield unit, slice(lo - unit_start, hi - unit_start), slice(lo - start, hi - start)

    def _on_device(self, unit: Unit) -> torch.Tensor | None:
        resident = self._residents.get(unit.name)
        if resident is None:
            return None
        return resident.master if self.name == "master" else resident.state[self.name]

    def _offloaded_here(self, unit: Unit) -> bool:
        return self._offloaded is not None and unit.name in self._offloaded.units


class StateSource(_PlacedArray):
    """An ``ArraySource`` for ``save_checkpoint``: ``"master"`` or an optimizer state name."""

    _staged: tuple[str, torch.Tensor] | None = None  # the last offloaded unit read, this state

    def _unit_state(self, unit: Unit) -> torch.Tensor:
        """The unit's flat array: a device tensor, a staged copy from the tier, or the host view."""
        on_device = self._on_device(unit)
        if on_device is not None:
            return on_device
        if self._offloaded_here(unit):
            assert self._offloaded is not None
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
        for unit, in_unit, in_block in self._pieces(start, out.numel()):
            out[in_block].copy_(self._unit_state(unit)[in_unit])


class StateSink(_PlacedArray):
    """An ``ArraySink`` for ``load_checkpoint`` (a resume): each block goes where its unit keeps the
    array. An offloaded unit's state is gathered whole in one unit-sized buffer, then written to the tier,
    so a resume needs no host memory for what lives on the GPU or the tier either."""

    _gathering: tuple[Unit, torch.Tensor, int] | None = None  # offloaded unit, its buffer, elements filled

    def write_from(self, start: int, block: torch.Tensor) -> None:
        for unit, in_unit, in_block in self._pieces(start, block.numel()):
            on_device = self._on_device(unit)
            if on_device is not None:
                on_device[in_unit].copy_(block[in_block])
            elif self._offloaded_here(unit):
                self._gather(unit, in_unit, block[in_block])
            else:
                self._host[unit.name][in_unit].copy_(block[in_block])

    def _gather(self, unit: Unit, in_unit: slice, piece: torch.Tensor) -> None:
        if self._gathering is None or self._gathering[0] is not unit:
            self._gathering = (unit, torch.empty(unit.layout.numel, dtype=torch.float32), 0)
        _, buffer, filled = self._gathering
        buffer[in_unit].copy_(piece)
        filled += piece.numel()
        self._gathering = (unit, buffer, filled)
        if filled == unit.layout.numel:
            assert self._offloaded is not None
            self._offloaded.load_state(unit.name, self.name, buffer)
            self._gathering = None
