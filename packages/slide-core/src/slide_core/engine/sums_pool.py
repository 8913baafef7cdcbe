"""The fp32 buffers a GPU-streamed update keeps a summed gradient in (Note [Streamed accumulation] in
streamed_pipeline.py): a pool that lends one to a staging set for as long as the unit in it sums.

Note [One sum per summing unit in flight]: a streamed unit with several gradient contributions a step (gradient
accumulation, a tied embedding's own share and its head's) brings the host's sum of the earlier ones up
beside its master and moments, in an fp32 buffer as long as the unit's shard. Such a buffer is needed only
while a summing unit holds a staging set, and at most ``min(summing units, sets)`` of them can: one per set,
and one per summing unit. Each set used to own one, sized for the largest unit, so a run whose only summing
unit is a tied embedding held three copies of the embedding's size (llama3.2-3b: 3 x 1.58 GB) where one
does. The pool holds that many, each as long as the largest summing unit's shard:

- a tied embedding alone (one micro-batch a step): one buffer, the embedding's size;
- with accumulation every streamed unit sums: one buffer per set, the largest unit's size, as before.

A summing unit takes a buffer with its set (:meth:`SumsPool.take`) and gives it back when the set is given
back, with the same event (:meth:`SumsPool.give_back`: the end of the write-back that last read it, which
follows the update that added to it on the compute stream). The next upload into the buffer waits for that
event on the h2d stream, as an upload into a set waits for the set's: no thread waits, and since a buffer
may serve a set other than the one it last served, the upload waits for both events. The buffer taken is
the one given back longest ago, whose write-back is likeliest done.

Sized for every unit the streamed path was built for (``EngineConfig.streamable_units`` too, Note
[Re-placement at a step boundary] in replacement.py), so moving units between the host and the device
allocates nothing. The pool is allocated at the first step that sums (:meth:`SumsPool.hold`: the engine
learns whether a run accumulates from the micro-batches a step gets) and never again for steps that sum the
same units. A run whose steps change from one micro-batch to several adds the buffers accumulation needs
then; where the largest block is larger than the tied embedding, the embedding's buffer stays beside them
(the pool never frees a buffer a write-back may still read). ``SumsPool.bytes_for`` is what the planner prices.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

import torch

from slide_core.device import Device, Event

__all__ = ["StagedSum", "SumsPool"]


@dataclass(eq=False)
class StagedSum:
    """One fp32 buffer of the pool: the host's sum of a unit's earlier contributions as it came up, then
    (the last contribution added on the device) the unit's final gradient."""

    values: torch.Tensor
    free_after: Event | None = None
    """The end of the write-back that last read it: the next upload into it waits for it."""


class SumsPool:
    """The summed-gradient buffers of one engine run's staging, lent to the staging sets of summing units
    (Note [One sum per summing unit in flight]). ``sets``: the staging sets, which bound how many summing
    units can be staged at once."""

    def __init__(self, device: Device, sets: int) -> None:
        self.buffers: list[StagedSum] = []
        """Every buffer the pool allocated, in the order it did."""
        self._free: deque[StagedSum] = deque()  # in the order given back: the first waited longest
        self._device, self._sets = device, sets

    @staticmethod
    def size_for(summing_numels: Collection[int], sets: int) -> tuple[int, int]:
        """Buffers and the elements of each for summing units of shards of ``summing_numels`` elements
        staged in turn through ``sets`` sets: one per unit that can be in flight, each as long as the
        longest shard; (0, 0) when no unit sums."""
        if not summing_numels or sets <= 0:
            return 0, 0
        return min(len(summing_numels), sets), max(summing_numels)

    @staticmethod
    def bytes_for(summing_numels: Collection[int], sets: int) -> int:
        """Device bytes of :meth:`size_for`'s buffers (fp32): what the planner prices."""
        count, numel = SumsPool.size_for(summing_numels, sets)
        return count * numel * torch.float32.itemsize

    def hold(self, summing_numels: Collection[int]) -> None:
        """Hold :meth:`size_for`'s buffers for a step whose summing units have shards of ``summing_numels``
        elements; allocates only the buffers of that size the pool does not hold yet (none after the first
        step that sums these units)."""
        count, numel = self.size_for(summing_numels, self._sets)
        fitting = sum(held.values.numel() >= numel for held in self.buffers)
        for _ in range(count - fitting):
            added = StagedSum(self._device.empty(numel, torch.float32))
            self.buffers.append(added)
            self._free.append(added)

    def take(self, numel: int) -> StagedSum:
        """A buffer no set holds of at least ``numel`` elements, the one given back longest ago (its
        ``free_after`` says when it may be written); held until :meth:`give_back`."""
        for index, held in enumerate(self._free):
            if held.values.numel() >= numel:
                del self._free[index]
                return held
        raise AssertionError("every summed-gradient buffer is held: more summing units staged than the pool holds")

    def give_back(self, held: StagedSum, free_after: Event | None) -> None:
        """The summing unit's write-back is queued: the buffer may be written again after ``free_after``."""
        held.free_after = free_after
        self._free.append(held)
