"""The device buffers a GPU-streamed update works in (streamed_pipeline.py): a few staging sets, each big
enough for the largest streamed unit's shard, holding its master as it crossed PCIe (fp32, or a split
master's planes) and its optimizer state as stored; and, for a split master, one fp32 buffer the update
decodes the planes into.

Why sets and not one buffer per unit: a streamed unit's master and moments live in host RAM and visit the
device only for the unit's update. Each set is reused once the write-back that last read it is done (an
event on the d2h stream, so no thread waits for it).

Note [Three staging sets]: a streamed unit's backward reads its weights from its staged master (Note [The
backward reads the staged master]), so unit i's upload must land before its backward starts, and it can
start only once its set's previous unit has been written back. With two sets that previous unit is i + 2,
whose write-back starts after its update, right after its backward: the write-back of i + 2 and the upload
of i then run one after the other inside the backward of i + 1, and each unit's period became their sum
(measured on an H100 host, llama3.1-8b with every block streamed, split master and bf16 moments: 66 ms a
block against 35 ms of backward; docs/benchmarks.md). With three, the set of unit i was last used by
i + 3, written back during the backward of i + 2: the upload of i and the write-back of i + 2 overlap in
the backward of i + 1, and the period is the larger of the backward and the link's time for both.

Why a set may hold a summed gradient too, in a run whose streamed units get several contributions a step
(gradient accumulation, a tied embedding): their earlier contributions are summed on the host, and the
sum travels up with the unit's master and moments to meet the last contribution on the device (Note
[Streamed accumulation] in streamed_pipeline.py). It lives exactly as long as the master beside it, so a
summing unit's set borrows an fp32 buffer from the staging's :class:`SumsPool` when it is taken and gives
it back with the set: the pool holds one buffer per summing unit that can be in flight, not one per set
(Note [One sum per summing unit in flight] in sums_pool.py; a run with one contribution per unit never
holds one).

Why one shared fp32 buffer for a split master: the backward reads the bf16 plane as it came, so only the
update needs the fp32 values; it decodes them on the compute stream right before its step and encodes
them back right after (one launch each with slide_kernels' codec), so one buffer serves every set, in
stream order, and a third set costs its planes and moments only.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from slide_core.device import Device, Event
from slide_core.optim.state_formats import StateArray
from slide_core.split_master import tie_bytes

from .sums_pool import StagedSum, SumsPool

__all__ = ["STAGING_SETS", "StagingSet", "UpdateStaging"]

STAGING_SETS = 3
"""One set being written back while the next unit's master and moments arrive in another and a third
unit's backward reads the last (Note [Three staging sets])."""


@dataclass
class StagingSet:
    """One unit shard's worth of device buffers."""

    master: torch.Tensor | None
    """The shard's fp32 master as it crossed PCIe (None for a split master: see ``planes``)."""
    planes: dict[str, torch.Tensor]
    """A split master's ``hi``, ``lo`` and ``ties`` as they crossed PCIe (empty for an fp32 master)."""
    state: dict[str, torch.Tensor]
    """Each optimizer state array as stored (fp32 moments, bf16 words, int8 codes and scales)."""
    free_after: Event | None = field(default=None)
    """The end of the write-back that last read this set: the next upload into it waits for it."""
    held: bool = False
    """Taken for a unit whose update has not been queued yet: not to be handed out again."""
    sums: StagedSum | None = None
    """Lent by the staging's :class:`SumsPool` while the unit in the set sums: the fp32 sum of its earlier
    gradient contributions as the host summed it, then its final gradient (None for a unit with one
    contribution, and while the set is free)."""


class UpdateStaging:
    """The staging sets of one engine run, handed out round-robin in upload order."""

    def __init__(
        self,
        device: Device,
        max_numel: int,
        state_arrays: Sequence[StateArray],
        *,
        split: bool,
        sets: int = STAGING_SETS,
    ) -> None:
        self.sets = [_new_set(device, max_numel, state_arrays, split=split) for _ in range(sets if max_numel else 0)]
        self.values = device.empty(max_numel, torch.float32) if split and max_numel else None
        """A split master's fp32 values during its update, for every set (compute stream only)."""
        self.sums = SumsPool(device, len(self.sets))
        """The summed gradients' buffers, lent to the sets of summing units (Note [One sum per summing unit
        in flight] in sums_pool.py)."""
        self._next = 0

    def hold_sums(self, summing_numels: Collection[int]) -> None:
        """Hold the summed-gradient buffers for a step whose summing streamed (and streamable) units have
        shards of ``summing_numels`` elements: allocated at the first step that sums them, never again."""
        self.sums.hold(summing_numels)

    @staticmethod
    def bytes_for(
        max_numel: int,
        state_arrays: Sequence[StateArray],
        *,
        split: bool,
        sets: int = STAGING_SETS,
        summing_numels: Collection[int] = (),
    ) -> int:
        """Device bytes of the sets for shards of up to ``max_numel`` elements: in each, the fp32 master or a
        split master's planes (2 + 2 bytes and a tie bit per element, plus an edge byte) and each state
        array as stored; for a split master, the one fp32 buffer its updates decode into; and the pool of
        summed gradients for the units that get several contributions a step, of shards of
        ``summing_numels`` elements (:meth:`SumsPool.bytes_for`). What the planner prices."""
        if max_numel <= 0:
            return 0
        master = 4 * max_numel + _tie_capacity(max_numel) if split else 4 * max_numel
        per_set = master + sum(a.numel(max_numel) * a.dtype.itemsize for a in state_arrays)
        return sets * per_set + (4 * max_numel if split else 0) + SumsPool.bytes_for(summing_numels, sets)

    def free(self) -> int:
        """Sets not held by a unit waiting for its update."""
        return sum(not staged.held for staged in self.sets)

    def take(self, sums_numel: int | None = None) -> StagingSet:
        """A set no unit holds, taken in turn (its ``free_after`` says when it may be written); held until
        :meth:`release` once the unit's update and write-back are queued. ``sums_numel``: the unit sums
        a shard of that many elements, and the set borrows a summed-gradient buffer for it (``sums``,
        whose own ``free_after`` says when it may be written)."""
        for _ in range(len(self.sets)):
            staged = self.sets[self._next]
            self._next = (self._next + 1) % len(self.sets)
            if not staged.held:
                staged.held = True
                staged.sums = None if sums_numel is None else self.sums.take(sums_numel)
                return staged
        raise AssertionError("every staging set is held: more units staged than sets")

    def release(self, staged: StagingSet, free_after: Event) -> None:
        """The unit's write-back is queued: the set, and the summed-gradient buffer it borrowed, may be
        written again after ``free_after``."""
        staged.free_after, staged.held = free_after, False
        self._give_back_sums(staged, free_after)

    def reset(self) -> None:
        """Start the next step's uploads from the first set (every set is free between steps)."""
        self._next = 0
        for staged in self.sets:
            staged.held = False
            self._give_back_sums(staged, staged.free_after)

    def _give_back_sums(self, staged: StagingSet, free_after: Event | None) -> None:
        if staged.sums is not None:
            self.sums.give_back(staged.sums, free_after)
            staged.sums = None


def _tie_capacity(numel: int) -> int:
    """Tie bytes covering ``numel`` bits that may start anywhere in their first byte."""
    return tie_bytes(numel) + 1


def _new_set(device: Device, numel: int, arrays: Sequence[StateArray], *, split: bool) -> StagingSet:
    planes: dict[str, torch.Tensor] = {}
    if split:
        planes = {
            "hi": device.empty(numel, torch.bfloat16),
            "lo": device.empty(numel, torch.int16),
            "ties": device.empty(_tie_capacity(numel), torch.uint8),
        }
    state = {a.name: device.empty(a.numel(numel), a.dtype) for a in arrays}
    return StagingSet(None if split else device.empty(numel, torch.float32), planes, state)
