"""Adam state of some units on a storage tier (NVMe), staged through host buffers around each update.

When host RAM cannot hold 8 bytes/param of Adam moments, the chosen units keep m and v on a
:class:`~slide_core.tier.Tier`. Two staging sets, each sized for the largest offloaded unit, act as a tiny
cache on the optimizer thread: ``acquire`` waits for (or starts) the read of a unit's state, the update
runs in place on the staging views, ``release`` starts the write-back, and ``prefetch`` starts the next
unit's read while the current one is being updated, so disk I/O overlaps the update.

Note [Staging reuse ordering]: a staging set is overwritten (by a read or by an update) only after the
write-back that last read it has completed, and a unit's state is read back only after its own last
write-back has completed: the tier may still be writing the bytes a read would return. Both waits are
on futures, bounded by ``timeout_s``. Tested by ``test_nvme_state_is_bit_identical_to_ram``.

Each state array keeps its own dtype on the tier and in the staging sets (``Optimizer.state_arrays``), so a
compact format moves only its bytes: 4 per parameter for bf16 moments instead of 8, about 2 for int8
(codes plus one fp32 scale per 64-element block), each way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, TimeoutError
from dataclasses import dataclass, field
from typing import Any

import torch

from slide_core.allocation_ledger import AllocationLedger
from slide_core.optim.state_formats import StateArray
from slide_core.tier import Tier, TierError
from slide_core.unit import SlideModel, Unit

from .config import EngineConfig

__all__ = ["STAGING_SETS", "OffloadedState"]

STAGING_SETS = 2
"""Staging sets in front of the tier: one unit's state read ahead while the previous one is updated."""


@dataclass
class _StagingSet:
    tensors: dict[str, torch.Tensor]
    owner: str | None = None
    reads: list[Future[torch.Tensor]] = field(default_factory=list)
    writes: list[Future[None]] = field(default_factory=list)
    last_used: float = 0.0
    dirty: bool = False  # acquired (so possibly updated) since the last write-back


def _wait(futures: list[Future[Any]], what: str, timeout_s: float) -> None:
    for future in futures:
        try:
            future.result(timeout=timeout_s)
        except TimeoutError:
            raise TierError(f"timed out after {timeout_s:.0f} s waiting for {what}") from None
    futures.clear()


class OffloadedState:
    """The optimizer state of ``units`` on ``tier``. Every method runs on the optimizer thread, or on the
    main thread while the optimizer thread is idle (a drain, a checkpoint, a resume)."""

    def __init__(
        self,
        tier: Tier,
        units: Sequence[Unit],
        state_names: Sequence[str | StateArray],
        timeout_s: float,
        sets: int = STAGING_SETS,
        *,
        ledger: AllocationLedger | None = None,
    ) -> None:
        """``state_names``: the optimizer's state arrays (a bare name is one fp32 element per parameter);
        ``ledger``: the engine's, which counts the staging sets."""
        self.tier = tier
        self.units = {unit.name: unit for unit in units}
        self.arrays = {a.name: a for a in (a if isinstance(a, StateArray) else StateArray(a) for a in state_names)}
        self.state_names = tuple(self.arrays)
        self.timeout_s = timeout_s
        largest = max((unit.layout.numel for unit in units), default=0)
        ledger = ledger or AllocationLedger()

        def staging(array: StateArray) -> torch.Tensor:
            return ledger.record(self, "nvme_staging", torch.empty(array.numel(largest), dtype=array.dtype))

        self._sets = [_StagingSet({a.name: staging(a) for a in self.arrays.values()}) for _ in range(sets)]
        self._written: set[str] = set()
        self._pending_writes: dict[str, list[Future[None]]] = {}
        self._shards: dict[str, tuple[int, int]] = {}

    def keep_shards(self, spans: Mapping[str, tuple[int, int]]) -> None:
        """Data parallel: keep only this rank's shard ``[lo, hi)`` of each unit on the tier (the rank updates
        nothing else), so the tier holds 1/N of the state. Staging stays one whole unit long, so the update
        addresses it as in one process; reads and write-backs move the shard only. Call before any I/O.
        A unit ``spans`` does not name is kept whole (``UnitShards.partial``: every unit in one process)."""
        for unit in self.units:
            if unit not in spans:
                continue
            lo, hi = spans[unit]
            for array in self.arrays.values():
                if array.numel(hi - lo) != hi - lo:
                    raise ValueError(f"optimizer state {array.name} is not one element per parameter: not sharded")
            self._shards[unit] = (lo, hi)

    def _stored(self, unit: str, tensor: torch.Tensor) -> torch.Tensor:
        """The part of one of ``unit``'s arrays (a staging view, a checkpoint's buffer) the tier keeps."""
        shard = self._shards.get(unit)
        return tensor if shard is None else tensor[shard[0] : shard[1]]

    @staticmethod
    def of_config(
        model: SlideModel,
        config: EngineConfig,
        tier: Tier | None,
        state_names: Sequence[str | StateArray],
        *,
        ledger: AllocationLedger | None = None,
    ) -> OffloadedState | None:
        """The state of ``config.offloaded_units`` on ``tier`` (None when there are none), checked."""
        if not config.offloaded_units:
            return None
        if tier is None:
            raise ValueError("offloaded_units needs a state_tier (e.g. slide_io's nvme tier)")
        unknown = set(config.offloaded_units) - {unit.name for unit in model.units}
        both = set(config.offloaded_units) & set(config.resident_units)
        if unknown or both:
            raise ValueError(f"offloaded_units: unknown {sorted(unknown)} or also resident {sorted(both)}")
        chosen = [unit for unit in model.units if unit.name in config.offloaded_units]
        return OffloadedState(tier, chosen, state_names, config.timeout_s, ledger=ledger)

    def __contains__(self, name: object) -> bool:
        return name in self.units

    @staticmethod
    def staging_bytes(arrays: Sequence[StateArray], largest_numel: int, sets: int = STAGING_SETS) -> int:
        """Host bytes of the staging sets in front of the tier: ``sets`` times one unit of
        ``largest_numel`` elements of every state array, as stored (the planner's ``nvme_staging``)."""
        return sets * sum(a.numel(largest_numel) * a.dtype.itemsize for a in arrays)

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._sets for t in s.tensors.values())

    def _key(self, unit: str, state: str) -> str:
        return f"{unit}/{state}"

    def _views(self, staging: _StagingSet, unit: str) -> dict[str, torch.Tensor]:
        numel = self.units[unit].layout.numel
        return {name: tensor[: self.arrays[name].numel(numel)] for name, tensor in staging.tensors.items()}

    def staged(self, unit: str, name: str) -> torch.Tensor:
        """A new host tensor the size and dtype of ``unit``'s array ``name`` (a checkpoint's staging)."""
        array = self.arrays[name]
        return torch.empty(array.numel(self.units[unit].layout.numel), dtype=array.dtype)

    def _find(self, unit: str) -> _StagingSet | None:
        return next((s for s in self._sets if s.owner == unit), None)

    def _claim(self, unit: str) -> _StagingSet:
        """A staging set for ``unit``: its own, else the least recently used one (after its write-back)."""
        staging = self._find(unit)
        if staging is not None:
            return staging
        staging = min(self._sets, key=lambda s: s.last_used)
        if staging.dirty and staging.owner is not None:
            # Its unit is part-way through an update (chunks of several units interleave): write back
            # what it has; its remaining chunks read it back (chunk ranges are disjoint).
            self.release(staging.owner)
        _wait(staging.writes, f"the write-back of {staging.owner}'s optimizer state", self.timeout_s)
        _wait(staging.reads, f"a read of {staging.owner}'s optimizer state", self.timeout_s)
        staging.owner = unit
        views = self._views(staging, unit)
        if unit not in self._written:  # never written: Adam state starts at zero
            for view in views.values():
                view.zero_()
            return staging
        _wait(self._pending_writes.get(unit, []), f"the write-back of {unit}'s optimizer state", self.timeout_s)
        staging.reads = [self.tier.get(self._key(unit, name), self._stored(unit, view)) for name, view in views.items()]
        return staging

    def prefetch(self, unit: str) -> None:
        """Start reading ``unit``'s state if a staging set is free of other pending work (a hint)."""
        if unit in self.units and self._find(unit) is None:
            self._claim(unit).last_used = time.monotonic()

    def acquire(self, unit: str) -> dict[str, torch.Tensor]:
        """``unit``'s state in host memory, ready to update in place."""
        staging = self._claim(unit)
        _wait(staging.writes, f"the write-back of {unit}'s optimizer state", self.timeout_s)
        _wait(staging.reads, f"the read of {unit}'s optimizer state", self.timeout_s)
        staging.last_used = time.monotonic()
        staging.dirty = True
        return self._views(staging, unit)

    def release(self, unit: str) -> None:
        """Start writing ``unit``'s updated state back to the tier; the staging set keeps a copy."""
        staging = self._find(unit)
        if staging is None:
            return
        views = self._views(staging, unit).items()
        writes = [self.tier.put(self._key(unit, name), self._stored(unit, view)) for name, view in views]
        staging.writes = list(writes)
        staging.dirty = False
        self._pending_writes[unit] = list(writes)
        self._written.add(unit)

    def load_from(self, unit: str, host_views: dict[str, torch.Tensor]) -> None:
        """Seed ``unit``'s state from host views (a checkpoint loaded into the host slabs)."""
        for name in self.state_names:
            self.load_state(unit, name, host_views[name])

    def load_state(self, unit: str, name: str, values: torch.Tensor) -> None:
        """Seed one state tensor of ``unit`` (a resume streaming a checkpoint); any staged copy is dropped."""
        staging = self._find(unit)
        if staging is not None:
            _wait(staging.reads, f"a read of {unit}'s optimizer state", self.timeout_s)
            staging.owner, staging.dirty = None, False
        _wait(self._pending_writes.get(unit, []), f"the write-back of {unit}'s optimizer state", self.timeout_s)
        stored = self._stored(unit, values)
        _wait([self.tier.put(self._key(unit, name), stored)], f"writing {unit}'s optimizer state", self.timeout_s)
        self._written.add(unit)

    def read(self, unit: str, name: str, out: torch.Tensor) -> None:
        """Copy one state tensor of ``unit`` into ``out`` (a checkpoint), waiting for pending I/O."""
        staging = self._find(unit)
        if staging is not None:
            _wait(staging.reads, f"the read of {unit}'s optimizer state", self.timeout_s)
            out.copy_(self._views(staging, unit)[name])
            return
        if unit not in self._written:
            out.zero_()
            return
        _wait(self._pending_writes.get(unit, []), f"the write-back of {unit}'s optimizer state", self.timeout_s)
        stored = self._stored(unit, out)
        _wait([self.tier.get(self._key(unit, name), stored)], f"reading {unit}'s optimizer state", self.timeout_s)

    def copy_to(self, unit: str, host_views: dict[str, torch.Tensor]) -> None:
        """Copy ``unit``'s current state into host views (a checkpoint), waiting for pending I/O."""
        staging = self._find(unit)
        if staging is not None:
            _wait(staging.reads, f"the read of {unit}'s optimizer state", self.timeout_s)
            for name, view in self._views(staging, unit).items():
                host_views[name].copy_(view)
            return
        if unit not in self._written:
            for view in host_views.values():
                view.zero_()
            return
        _wait(self._pending_writes.get(unit, []), f"the write-back of {unit}'s optimizer state", self.timeout_s)
        _wait(
            [self.tier.get(self._key(unit, name), self._stored(unit, host_views[name])) for name in self.state_names],
            f"reading {unit}'s optimizer state",
            self.timeout_s,
        )

    def flush(self) -> None:
        """Wait for every write-back (the engine's drain)."""
        for staging in self._sets:
            _wait(staging.writes, "an optimizer-state write-back", self.timeout_s)
