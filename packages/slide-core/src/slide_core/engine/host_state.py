"""The host's fp32 buffers besides the master: every unit's optimizer state, laid out like the master slab,
and the gradient accumulators of host-updated units.

The state slabs cover every unit, so a checkpoint gathered in them has the master's layout. A
device-resident or tier-offloaded unit's range is left unwritten (its pages never touched, costing no
RSS) until a drain with state copies the unit's state into it; ``valid`` says which ranges hold real
values.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from slide_core.host_params import HostParameters
from slide_core.unit import SlideModel, Unit

__all__ = ["HostState"]


class HostState:
    """Optimizer state slabs (one fp32 slab per state name) and per-unit fp32 gradient accumulators."""

    def __init__(
        self, model: SlideModel, host_params: HostParameters, state_names: Sequence[str], elsewhere: Collection[str]
    ) -> None:
        """``elsewhere``: the units whose state lives off the host (on the device, on a tier)."""
        self.host_params = host_params
        self.state_slabs = {name: torch.empty(host_params.numel, dtype=torch.float32) for name in state_names}
        self.valid = {unit.name: unit.name not in elsewhere for unit in model.units}
        # Zeroed by ``zero_fresh`` when the engine starts, not here: the engine first gives back the host
        # pages of device-resident masters, so the two never add up in the peak.
        self._fresh = [unit for unit in model.units if unit.name not in elsewhere]
        self._accum: dict[str, torch.Tensor] = {}

    @property
    def host_bytes(self) -> int:
        state = sum(t.numel() * t.element_size() for t in self.state_slabs.values())
        return state + sum(t.numel() * t.element_size() for t in self._accum.values())

    def views(self, unit: Unit | str) -> dict[str, torch.Tensor]:
        """This unit's flat optimizer state, one view per state name."""
        master = self.host_params.flat(unit)
        start = (master.data_ptr() - self.host_params.slab.data_ptr()) // master.element_size()
        return {name: slab[start : start + master.numel()] for name, slab in self.state_slabs.items()}

    def accumulator(self, unit: Unit) -> torch.Tensor:
        """The unit's fp32 gradient accumulator (optimizer thread). Allocated on first use only: with no
        accumulation and no tied weights, none is ever needed; reused by every later step."""
        accum = self._accum.get(unit.name)
        if accum is None:
            accum = torch.empty(unit.layout.numel, dtype=torch.float32)
            self._accum[unit.name] = accum
        return accum

    def zero_fresh(self, spans: Mapping[str, tuple[int, int]] | None = None) -> None:
        """Zero the state of a fresh run's host-updated units (Adam starts from m = v = 0).

        ``spans``: only the range ``[lo, hi)`` of each unit (a data-parallel rank's shards, the only state
        it ever updates), so the pages of the rest are never touched and cost the rank no memory."""
        for unit in self._fresh:
            lo, hi = spans[unit.name] if spans is not None else (0, unit.layout.numel)
            for view in self.views(unit).values():
                view[lo:hi].zero_()
        self._fresh = []

    def mark_valid(self) -> None:
        """Every unit's range now holds real values (a drain copied the state of the others in)."""
        self.valid = dict.fromkeys(self.valid, True)
        self._fresh = []

    def drop(self) -> None:
        """Free the host optimizer state (the run is over and will not be checkpointed again)."""
        self.state_slabs = {name: torch.empty(0, dtype=torch.float32) for name in self.state_slabs}
        self._accum.clear()
        self.valid = dict.fromkeys(self.valid, False)
