"""Which of the streamable units the GPU-streamed path updates on the device: a placement that a run may
change between two steps.

Where a unit's update runs (the host optimizer, or the device as the unit streams through it) is chosen by
the plan before the run, from rates the run has not measured yet. A run that finds the host AdamW slower or
faster in its own steps than planned may move units between the two places. Both places keep the unit's
master and moments in the host slabs and do the same arithmetic on them (Note [Streamed updates are the
host's arithmetic] in streamed_pipeline.py), so a move changes where the work runs, never the result.

Note [Re-placement at a step boundary]: the streamed path is built once, for every unit it may ever update
(``EngineConfig.streamed_units`` and ``EngineConfig.streamable_units``): their shards, their pinned host
ranges and staging sets sized for the largest of them. A move only changes which of them
:class:`StreamedPlacement` names, so it allocates nothing. :meth:`Engine.place_streamed` makes a move
between two steps, once every 'updated' future of the last step is resolved and every write-back has landed
(Note [Update futures]): no unit is then halfway through an update in either place, and the next step reads
the placement once, when it begins (``StepContext.device_updated``), and never again. A unit the streamed
path does not update on the device takes the host optimizer's path in that pipeline, the path a streamed
unit already takes in a deferred clipped step (Note [When a streamed unit is updated on the host]).
Tested by tests/core/test_engine_replacement.py, which moves units both ways mid-run and ends with the
all-host run's masters and moments bit for bit.

What a move does not change: the gradient ring stays sized for the units the run started with on the host
(Note [The ring is sized for the host's units]); more host units with the same ring only make the backward
wait for free chunks sooner, never change a value.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["StreamedPlacement"]


class StreamedPlacement:
    """The units the streamed path updates on the device now (``streamed``), out of those it was built for
    (``streamable``). Read by the main thread when a step begins; changed by :meth:`move` between steps."""

    def __init__(self, streamable: Iterable[str], streamed: Iterable[str]) -> None:
        self.streamable = frozenset(streamable)
        self.streamed: frozenset[str] = frozenset()
        self.move(streamed)

    def __contains__(self, name: object) -> bool:
        return name in self.streamed

    def move(self, names: Iterable[str]) -> tuple[frozenset[str], frozenset[str]]:
        """Update ``names`` on the device from the next step, every other streamable unit on the host.
        Returns the units that move to the device and those that move to the host. A name the streamed
        path was not built for raises ``ValueError`` naming it (the staging has no room for it)."""
        chosen = frozenset(names)
        unknown = sorted(chosen - self.streamable)
        if unknown:
            raise ValueError(
                f"units {', '.join(unknown)} cannot be updated on the GPU in this run: the streamed path was built "
                f"for {', '.join(sorted(self.streamable)) or 'no unit'} (EngineConfig.streamable_units)"
            )
        to_device, to_host = chosen - self.streamed, self.streamed - chosen
        self.streamed = chosen
        return to_device, to_host
