"""One fp32 array of the whole model (the master, or an optimizer state), read for a checkpoint from
wherever each unit keeps it.

A host-updated unit's master and state are in the host slabs, a device-resident unit's on the GPU, an
offloaded unit's state on a storage tier. Gathering all of it in the host slabs before a save
(``drain(with_state=True)``) touches 12 bytes of host memory per resident parameter (4 for the master,
whose pages the engine gave back, see Note [Resident host copies]) and 8 per offloaded one, which a run
that moved them off the host precisely for lack of RAM may not have: qwen2.5-14b on a whole H200 would
need 31 GiB more for its resident masters alone. :class:`StateSource` instead lets the checkpoint
writer pull the file's bytes block by block (:class:`~slide_core.checkpoint.ArraySource`): a block
copies each unit's range from where the unit's pipeline keeps it (``UnitPipeline.state_array``: host
ranges, device ranges, one offloaded unit at a time), in the slabs' element order, so the file is the
same as one written from gathered slabs. :class:`StateSink` is the mirror for a resume.

With data parallel each rank's array covers only its shard ``[lo, hi)`` of every unit (``spans``): the
sharded pipeline's ``state_array`` is that range alone, so a rank's file is its shards in slab order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from slide_core.optim.state_formats import StateArray
from slide_core.unit import Unit

from .pipeline import UnitPipeline

__all__ = ["StateSink", "StateSource"]


class _PlacedArray:
    """Array ``name`` (``"master"`` or an optimizer state) over ``units`` in slab order, each unit's range
    kept where the unit's pipeline keeps it. ``spans``: the part ``[lo, hi)`` of each unit the array holds
    (this rank's shard of it: the whole unit in a world of one). ``array``: how the array is stored (its
    dtype, and one entry per block of parameters for int8's scales); one fp32 element per parameter when
    None."""

    def __init__(
        self,
        name: str,
        units: Sequence[Unit],
        pipelines: Mapping[str, UnitPipeline],
        spans: Mapping[str, tuple[int, int]],
        array: StateArray | None = None,
    ) -> None:
        array = array or StateArray(name)
        self.name = name
        self.dtype = array.dtype
        self._units = list(units)
        self._pipelines = pipelines
        self._lengths = [_length(array.range(*spans[unit.name])) for unit in self._units]
        self._numel_of = {unit.name: length for unit, length in zip(self._units, self._lengths, strict=True)}
        self.whole_numel, self.intervals = _placement(array, self._units, spans)
        """The whole array's size and the ranges of it this array holds (a checkpoint ``Shard``)."""
        self._starts = []
        total = 0
        for length in self._lengths:
            self._starts.append(total)
            total += length
        self.numel = total

    def _pieces(self, start: int, count: int) -> Iterator[tuple[Unit, slice, slice]]:
        """The units overlapping ``[start, start + count)``: (unit, range in the unit, range in the block)."""
        end = start + count
        for unit, unit_start, length in zip(self._units, self._starts, self._lengths, strict=True):
            lo, hi = max(start, unit_start), min(end, unit_start + length)
            if lo < hi:
                yield unit, slice(lo - unit_start, hi - unit_start), slice(lo - start, hi - start)


class StateSource(_PlacedArray):
    """An ``ArraySource`` for ``save_checkpoint``."""

    _current: tuple[Unit, torch.Tensor] | None = None  # the last unit read (a tier's copy is read once)

    def read_into(self, start: int, out: torch.Tensor) -> None:
        for unit, in_unit, in_block in self._pieces(start, out.numel()):
            if self._current is None or self._current[0] is not unit:
                self._current = None  # let the previous unit's staged copy go first
                self._current = (unit, self._pipelines[unit.name].state_array(unit, self.name))
            out[in_block].copy_(self._current[1][in_unit])


class StateSink(_PlacedArray):
    """An ``ArraySink`` for ``load_checkpoint`` (a resume): each block goes where its unit keeps the array
    (``UnitPipeline.restore_target``); an offloaded unit's state is gathered whole in one unit-sized
    buffer, then written to the tier, so a resume needs no host memory for what lives on the GPU or the
    tier either."""

    _filling: tuple[Unit, torch.Tensor, int] | None = None  # unit, where its array goes, elements written

    def write_from(self, start: int, block: torch.Tensor) -> None:
        for unit, in_unit, in_block in self._pieces(start, block.numel()):
            pipeline = self._pipelines[unit.name]
            if self._filling is None or self._filling[0] is not unit:
                self._filling = (unit, pipeline.restore_target(unit, self.name), 0)
            _, target, filled = self._filling
            target[in_unit].copy_(block[in_block])
            filled += in_unit.stop - in_unit.start
            self._filling = (unit, target, filled)
            if filled == self._numel_of[unit.name]:
                self._filling = None
                pipeline.restored(unit, self.name, target)


def _placement(
    array: StateArray, units: Sequence[Unit], spans: Mapping[str, tuple[int, int]]
) -> tuple[int, list[tuple[int, int]]]:
    """``(entries of the whole array, the ranges [start, stop) of them that ``spans`` of each unit hold)``."""
    intervals, start = [], 0
    for unit in units:
        held = array.range(*spans[unit.name])
        intervals.append((start + held.start, start + held.stop))
        start += array.numel(unit.layout.numel)
    return start, intervals


def _length(entries: slice[int, int, int | None]) -> int:
    return entries.stop - entries.start
