"""This rank's shard of every unit: the shard part of a unit's pipeline.

Every unit pipeline updates, checkpoints and restores only this rank's contiguous shard ``[lo, hi)`` of
each unit's flat range, and moves the rest through the run's :class:`~slide_core.collectives.Collectives`
(docs/distributed.md). In one process the shard is the whole unit and the collectives do nothing (Note
[Collectives at world size one] in slide_core/collectives.py), so the pipelines have one path.
"""

from __future__ import annotations

from collections.abc import Sequence

from slide_core.collectives import Collectives
from slide_core.unit import Unit

__all__ = ["UnitShards"]


class UnitShards:
    """``collectives`` and this rank's shard ``[lo, hi)`` of each of ``units``; refuses a unit too small to
    give every rank a shard."""

    def __init__(self, collectives: Collectives, units: Sequence[Unit]) -> None:
        self.collectives = collectives
        self.spans: dict[str, tuple[int, int]] = {}
        self._numel: dict[str, int] = {}
        for unit in units:
            lo, hi = self.spans[unit.name] = collectives.span(unit.layout.numel)
            self._numel[unit.name] = unit.layout.numel
            if hi <= lo:
                raise ValueError(
                    f"unit {unit.name} has {unit.layout.numel} elements, too few to give each of "
                    f"{collectives.world_size} ranks a shard"
                )

    def __getitem__(self, name: str) -> tuple[int, int]:
        return self.spans[name]

    def numel(self, name: str) -> int:
        """The whole unit's number of elements."""
        return self._numel[name]

    def partial(self) -> dict[str, tuple[int, int]]:
        """The shards of the units this rank holds only part of (none in one process): what a host
        master or a tier keeps of them (Note [Sharded master] in host_pipeline.py)."""
        return {name: span for name, span in self.spans.items() if span != (0, self._numel[name])}

    def cut(self, name: str, pieces: Sequence[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
        """``(lo, hi, decay)`` pieces of a unit cut to its shard (as they are for a whole-unit shard)."""
        lo, hi = self.spans[name]
        return [(max(a, lo), min(b, hi), decay) for a, b, decay in pieces if max(a, lo) < min(b, hi)]
