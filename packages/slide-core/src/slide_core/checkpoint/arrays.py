"""What a checkpoint is written from and read into: host tensors, or arrays pulled and pushed block by
block, each holding the whole array or a rank's shard of it.

An array is flat: the master, or one optimizer state, every unit in slab order. A data-parallel rank holds
its shard ``[lo, hi)`` of every unit, which is a list of flat ranges of the whole array (its
:class:`Shard` ``intervals``); a single process holds one range, the whole array. The checkpoint records
those ranges per rank, which is what lets a load reshard: any rank of any world size asks for its own
ranges and gets them from whichever shard files hold them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ["ArraySink", "ArraySource", "Interval", "Shard", "as_bytes", "normalized", "placement"]

Interval = tuple[int, int]
"""Elements ``[start, stop)`` of a whole flat array."""


@runtime_checkable
class ArraySource(Protocol):
    """A flat array that is not one host tensor (e.g. optimizer state partly on the GPU or on NVMe): the
    save pulls it one block at a time through a single bounded buffer instead of gathering it in RAM."""

    numel: int
    dtype: torch.dtype

    def read_into(self, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` (flat, host) with elements ``[start, start + out.numel())``."""


@runtime_checkable
class ArraySink(Protocol):
    """The mirror of :class:`ArraySource` for loading: each verified block is handed over to be put where
    its elements live (host, GPU, a storage tier), so a load needs one bounded buffer, not the array."""

    numel: int
    dtype: torch.dtype

    def write_from(self, start: int, block: torch.Tensor) -> None:
        """Store ``block`` (flat, host) as elements ``[start, start + block.numel())``."""


@runtime_checkable
class Shard(Protocol):
    """An array source or sink that holds part of a whole array: ``intervals`` (flat ranges of the whole
    array of ``whole_numel`` elements, in its own element order). An array without them is whole."""

    whole_numel: int
    intervals: Sequence[Interval]


def normalized(intervals: Sequence[Interval]) -> tuple[Interval, ...]:
    """``intervals`` without empty ones, adjacent ones merged (a single process's shard of every unit is
    one range, the whole array)."""
    merged: list[Interval] = []
    for start, stop in intervals:
        if start == stop:
            continue
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return tuple(merged)


def placement(array: torch.Tensor | ArraySource | ArraySink) -> tuple[int, tuple[Interval, ...]]:
    """``(whole numel, the ranges of it that array holds)``; checked to add up to the array's numel."""
    numel = array.numel() if isinstance(array, torch.Tensor) else array.numel
    if not isinstance(array, Shard):
        return numel, normalized([(0, numel)])
    intervals = normalized(array.intervals)
    if sum(stop - start for start, stop in intervals) != numel:
        raise ValueError(f"an array of {numel} elements names ranges of {intervals} of its whole array")
    return array.whole_numel, intervals


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, without a copy."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("checkpoint tensors must be contiguous host tensors")
    return tensor.view(torch.uint8).numpy().data
