"""The host's buffers besides the master: every unit's optimizer state, laid out like the master slab,
and the fp32 gradient accumulators of host-updated units.

The state slabs cover every unit, so a checkpoint gathered in them has the master's layout. A
device-resident or tier-offloaded unit's range is left unwritten (its pages never touched, costing no
RSS) until a drain with state copies the unit's state into it; ``valid`` says which ranges hold real
values.

Each slab has its state array's dtype (``Optimizer.state_arrays``: fp32 moments, bf16 ones, int8 codes);
an array with one entry per block of parameters (int8's fp32 scales) has one entry per block of the
master slab. Every unit starts on a block (the layout's 64-element alignment), so a unit's entries are the
slab's ``[start / block, end / block)``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from slide_core.allocation_ledger import AllocationLedger
from slide_core.host_params import HostParameters
from slide_core.optim.state_formats import StateArray
from slide_core.unit import SlideModel, Unit

__all__ = ["HostState"]

_ACCUMULATOR_DTYPE = torch.float32


class HostState:
    """Optimizer state slabs (one per state array, in its dtype) and per-unit fp32 gradient accumulators."""

    def __init__(
        self,
        model: SlideModel,
        host_params: HostParameters,
        state_names: Sequence[str | StateArray],
        elsewhere: Collection[str],
        *,
        ledger: AllocationLedger | None = None,
    ) -> None:
        """``state_names``: the optimizer's state arrays (a bare name is one fp32 element per parameter);
        ``elsewhere``: the units whose state lives off the host (on the device, on a tier). ``ledger``:
        the engine's, which counts the slabs and the accumulators (their units' ranges the engine never
        writes taken off)."""
        self.host_params = host_params
        self.arrays = tuple(a if isinstance(a, StateArray) else StateArray(a) for a in state_names)
        self._ledger = ledger or AllocationLedger()
        self.state_slabs = {
            a.name: self._ledger.record(self, "optimizer_state", torch.empty(a.numel(host_params.numel), dtype=a.dtype))
            for a in self.arrays
        }
        self.valid = {unit.name: unit.name not in elsewhere for unit in model.units}
        for unit in model.units:  # never written unless a drain with state copies them in
            if unit.name in elsewhere:
                for view in self.views(unit).values():
                    self._ledger.leave_untouched(view)
        # Zeroed by ``zero_fresh`` when the engine starts, not here: the engine first gives back the host
        # pages of device-resident masters, so the two never add up in the peak.
        self._fresh = [unit for unit in model.units if unit.name not in elsewhere]
        self._accum: dict[str, torch.Tensor] = {}

    @staticmethod
    def state_bytes(arrays: Sequence[StateArray], unit_numels: Sequence[int]) -> int:
        """Host bytes of the state slabs' ranges that units of ``unit_numels`` elements touch: each
        array as stored (a block array has one entry per block of each unit, every unit starting on a
        block). The ranges of units whose state lives elsewhere are allocated but never touched, so they
        cost no memory; the planner passes the host-updated units only."""
        return sum(a.numel(numel) * a.dtype.itemsize for a in arrays for numel in unit_numels)

    @staticmethod
    def accumulator_bytes(unit_numels: Sequence[int]) -> int:
        """Host bytes of the fp32 gradient accumulators of units of ``unit_numels`` elements: the
        host-updated units that get more than one gradient contribution per step."""
        return sum(_ACCUMULATOR_DTYPE.itemsize * numel for numel in unit_numels)

    @property
    def host_bytes(self) -> int:
        state = sum(t.numel() * t.element_size() for t in self.state_slabs.values())
        return state + sum(t.numel() * t.element_size() for t in self._accum.values())

    def views(self, unit: Unit | str) -> dict[str, torch.Tensor]:
        """This unit's flat optimizer state, one view per state name."""
        start, end = self.host_params.extent(unit)
        return {a.name: self.state_slabs[a.name][a.range(start, end)] for a in self.arrays}

    def range(self, views: Mapping[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Parameters ``[lo, hi)`` of one unit's state ``views`` (block arrays: the blocks holding them)."""
        return {a.name: views[a.name][a.range(lo, hi)] for a in self.arrays}

    def accumulator(self, unit: Unit, numel: int | None = None) -> torch.Tensor:
        """The unit's fp32 gradient accumulator (optimizer thread), of ``numel`` elements (the shard of the
        unit this rank sums; by default the whole unit). Allocated on first use only: with no accumulation
        and no tied weights, none is ever needed; reused by every later step."""
        accum = self._accum.get(unit.name)
        if accum is None:
            numel = unit.layout.numel if numel is None else numel
            accum = self._ledger.record(self, "grad_accumulators", torch.empty(numel, dtype=_ACCUMULATOR_DTYPE))
            self._accum[unit.name] = accum
        return accum

    def zero_fresh(self, spans: Mapping[str, tuple[int, int]] | None = None) -> None:
        """Zero the state of a fresh run's host-updated units (Adam starts from m = v = 0).

        ``spans``: only the range ``[lo, hi)`` of each unit (a data-parallel rank's shards, the only state
        it ever updates), so the pages of the rest are never touched and cost the rank no memory; a unit
        ``spans`` does not name is zeroed whole."""
        for unit in self._fresh:
            lo, hi = (spans or {}).get(unit.name, (0, unit.layout.numel))
            whole = self.views(unit)
            for name, view in self.range(whole, lo, hi).items():
                view.zero_()
                self._ledger.leave_untouched(whole[name], _nbytes(whole[name]) - _nbytes(view))  # other ranks'
        self._fresh = []

    def mark_valid(self) -> None:
        """Every unit's range now holds real values (a drain copied the state of the others in)."""
        self.valid = dict.fromkeys(self.valid, True)
        self._fresh = []

    def drop(self) -> None:
        """Free the host optimizer state (the run is over and will not be checkpointed again)."""
        self.state_slabs = {a.name: torch.empty(0, dtype=a.dtype) for a in self.arrays}
        self._accum.clear()
        self.valid = dict.fromkeys(self.valid, False)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
