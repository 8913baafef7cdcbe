"""Device cache slots and the window that decides what to load into them, and when.

A slot holds one unit's parameters (compute dtype) and gradients in preallocated device memory. Block units
share ``block_slots`` slots; the embedding and head units have a slot each because they can be much larger
than a block (a 128K vocabulary is 2.4 blocks of Llama-3.1-8B).

Note [Slot reuse ordering]: three events guard a slot's memory.
- ``ready``: the host-to-device copy of the current contents finished. Compute waits for it.
- ``compute_done``: the last compute that read the parameters finished. A new h2d into the slot waits.
- ``grads_free``: the device-to-host copy of the gradients finished. Writing new gradients waits.
Every wait is a stream-side wait (no host blocking) except the future that says an h2d was *issued*.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from slide_core.device import Device, Event
from slide_core.unit import Unit

__all__ = ["ParamSlot", "SlotWindow", "Visit"]


@dataclass
class ParamSlot:
    """Preallocated device memory for one unit's parameters and gradients."""

    index: int
    params: torch.Tensor
    grads: torch.Tensor
    unit: Unit | None = None
    loaded: Future[Event] | None = None
    compute_done: Event | None = None
    grads_free: Future[Event] | None = None
    """The d2h job of the gradient buffer's last contents: done when the buffer may be written again."""

    @property
    def numel(self) -> int:
        return self.params.numel()


@dataclass(frozen=True)
class Visit:
    """One use of a unit's parameters by compute, in schedule order."""

    unit: Unit
    phase: str  # "forward", "head" or "backward"; "eval" in an evaluation's schedule
    micro_batch: int


@dataclass
class _Pools:
    blocks: list[ParamSlot] = field(default_factory=list)
    dedicated: dict[str, ParamSlot] = field(default_factory=dict)


class SlotWindow:
    """Residency of units in device slots, with Belady-style eviction over a known schedule.

    The schedule of one optimizer step is known in advance (forward, head, backward, for each
    micro-batch), so the window evicts the resident unit whose next use is farthest away and prefetches
    upcoming units into slots as soon as that does not evict anything needed sooner.
    """

    def __init__(self, device: Device, blocks: list[Unit], edge_units: list[Unit], slots: int, dtype: torch.dtype):
        self.device = device
        self.pools = _Pools()
        block_numel = max((unit.layout.numel for unit in blocks), default=0)
        for index in range(self.block_slot_count(blocks, slots)):
            self.pools.blocks.append(
                ParamSlot(index, device.empty(block_numel, dtype), device.empty(block_numel, dtype))
            )
        for offset, unit in enumerate(edge_units):
            slot = ParamSlot(
                slots + offset, device.empty(unit.layout.numel, dtype), device.empty(unit.layout.numel, dtype)
            )
            self.pools.dedicated[unit.name] = slot
        self._schedule: list[Visit] = []
        self._uses: dict[int, list[int]] = {}  # id(unit) -> its positions in the schedule, ascending
        self._position = 0

    @staticmethod
    def block_slot_count(blocks: Sequence[object], slots: int) -> int:
        """Block slots the window allocates: ``slots``, or none when every block is elsewhere (``blocks``:
        the sliding blocks, as units or as their sizes)."""
        return slots if blocks else 0

    @staticmethod
    def slot_bytes(numel: int, dtype_bytes: int) -> int:
        """Device bytes of one slot of ``numel`` elements: its parameters and its gradients, both in the
        compute dtype. Block slots are all as large as the largest sliding block; the embedding and the
        head, when they slide, have one slot each of their own numel. The planner prices slots from this."""
        return 2 * numel * dtype_bytes

    @property
    def device_bytes(self) -> int:
        slots = [*self.pools.blocks, *self.pools.dedicated.values()]
        return sum(self.slot_bytes(s.params.numel(), s.params.element_size()) for s in slots)

    def all_slots(self) -> list[ParamSlot]:
        return [*self.pools.blocks, *self.pools.dedicated.values()]

    def start_step(self, schedule: list[Visit]) -> None:
        """New parameters arrive every step: forget residency, keep the events that guard memory."""
        self._schedule = schedule
        self._position = 0
        self._uses = {}  # id(unit) -> its positions in the schedule, ascending
        for position, visit in enumerate(schedule):
            self._uses.setdefault(id(visit.unit), []).append(position)
        for slot in self.all_slots():
            slot.unit = None
            slot.loaded = None

    def advance(self, position: int) -> None:
        self._position = position

    def resident(self, unit: Unit) -> ParamSlot | None:
        for slot in self._candidates(unit):
            if slot.unit is unit:
                return slot
        return None

    def _candidates(self, unit: Unit) -> list[ParamSlot]:
        dedicated = self.pools.dedicated.get(unit.name)
        return [dedicated] if dedicated is not None else self.pools.blocks

    def _next_use(self, unit: Unit, after: int) -> int:
        """The first position >= ``after`` that uses ``unit`` (past the end when there is none)."""
        uses = self._uses.get(id(unit), [])
        index = bisect.bisect_left(uses, after)
        return uses[index] if index < len(uses) else len(self._schedule) + 1

    def slot_for(self, unit: Unit, needed_at: int, pinned: set[int]) -> ParamSlot | None:
        """A slot to load ``unit`` into for use at ``needed_at``, or None if that would evict a unit
        needed sooner. ``pinned`` holds slot indices in use by the current visit."""
        best: ParamSlot | None = None
        best_next = -1
        for slot in self._candidates(unit):
            if slot.index in pinned:
                continue
            if slot.unit is None:
                return slot
            next_use = self._next_use(slot.unit, self._position)
            if next_use > best_next:
                best, best_next = slot, next_use
        if best is None or best_next <= needed_at:
            return None
        return best
