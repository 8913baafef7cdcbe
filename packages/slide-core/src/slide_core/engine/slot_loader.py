"""Slot acquisition and prefetching: which device slot holds each visit's unit, and when it is loaded.

The compute of a visit needs its unit in a slot: :meth:`SlotLoader.acquire` finds the slot that already
holds it (a device-resident unit's fixed slot, or a window slot loaded earlier), or picks one and loads
it, then prefetches the next visits' units into free slots, and finally makes the compute stream wait for
the load. A load runs on the h2d thread through the unit's pipeline, after the unit's last update
(``ready_after``, Note [Update futures] in docs/design/engine.md) and after the compute that last read the
slot (Note [Slot reuse ordering] in slots.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future

from slide_core.device import Device
from slide_core.unit import Unit

from .slots import ParamSlot, SlotWindow, Visit
from .timeline import Timeline
from .unit_pipelines import UnitPipelines
from .workers import EngineError, Workers

__all__ = ["SlotLoader"]


class SlotLoader:
    """Loads the units of a schedule into ``window``'s slots through their ``pipelines``."""

    def __init__(
        self,
        device: Device,
        window: SlotWindow,
        pipelines: UnitPipelines,
        workers: Workers,
        timeline: Timeline,
        ready_after: Mapping[str, Future[None]],
    ) -> None:
        self.device, self.window, self.pipelines, self.workers, self.timeline = (
            device, window, pipelines, workers, timeline,
        )  # fmt: skip
        self.ready_after = ready_after
        """Each unit's future a load waits for: the previous step's updates (or, for an evaluation, the
        latest ones)."""

    def acquire(self, position: int, schedule: list[Visit], unit: Unit, pinned: set[int] | None = None) -> ParamSlot:
        """The slot holding ``unit`` for the visit at ``position``; loads it if needed, then prefetches."""
        window, workers = self.window, self.workers
        window.advance(position)
        pinned = set(pinned or ())
        fixed = self.pipelines.fixed.get(unit.name)
        if fixed is not None:
            self._prefetch(position, schedule, pinned)
            return fixed
        slot = window.resident(unit)
        if slot is None:
            slot = window.slot_for(unit, position, pinned)
            if slot is None:
                raise EngineError(f"no device slot free for {unit.name}; raise block_slots")
            self._load(slot, unit)
        pinned.add(slot.index)
        self._prefetch(position, schedule, pinned)
        began = time.perf_counter()
        assert slot.loaded is not None
        loaded = workers.wait(slot.loaded, f"the parameters of {unit.name}")
        self.timeline.host_span(unit.name, "wait", (time.perf_counter() - began) * 1e3)
        self.device.wait_event("compute", loaded)
        return slot

    def _prefetch(self, position: int, schedule: list[Visit], pinned: set[int]) -> None:
        horizon = min(len(schedule), position + 1 + len(self.window.all_slots()))
        for ahead in range(position + 1, horizon):
            unit = schedule[ahead].unit
            if unit.name in self.pipelines.fixed or self.window.resident(unit) is not None:
                continue
            slot = self.window.slot_for(unit, ahead, pinned)
            if slot is None:
                continue
            self._load(slot, unit)

    def _load(self, slot: ParamSlot, unit: Unit) -> None:
        slot.unit = unit
        pipeline = self.pipelines[unit.name]
        pipeline.before_load(unit)
        slot.loaded = self.workers["h2d"].submit(
            pipeline.load, unit, slot, self.ready_after[unit.name], slot.compute_done
        )
