"""Which units to update on the GPU as they stream, from each unit's measured costs: a pure function.

A host-updated unit costs PCIe d2h (its gradient), host memory and CPU time (the host AdamW); a
GPU-streamed one costs PCIe both ways (master and moments travel with it) and GPU time (its update) instead.
Which is cheaper for the step depends on which resource binds: a machine whose host optimizer is the
bottleneck gains by streaming units until PCIe or the GPU binds; one whose GPU binds gains nothing.
:func:`choose_streamed_units` makes that choice; slide_hf/planner/plan.py feeds it the costs of
slide_hf/planner/unit_costs.py and the GPU memory a plan leaves spare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from slide_hf.planner.unit_costs import RESOURCES, UnitCost, resource_times

__all__ = ["choose_streamed_units", "step_resources"]

_EPSILON = 1e-9
"""A move must lower the step time by more than this fraction: float noise is not a gain."""


def step_resources(fixed: Mapping[str, float], units: Sequence[UnitCost], streamed: set[str]) -> dict[str, float]:
    """Seconds per step of each resource when the units in ``streamed`` are GPU-streamed and the rest of
    ``units`` host-updated; ``fixed`` holds everything else (compute, the stash, resident units)."""
    return resource_times(fixed, units, {unit.name: "streamed" for unit in units if unit.name in streamed})


def choose_streamed_units(
    fixed: Mapping[str, float], units: Sequence[UnitCost], device_budget_bytes: int
) -> tuple[str, ...]:
    """The units of ``units`` to GPU-stream (in ``units``' order) so that the step's largest resource time
    is smallest, with the streamed updates' GPU memory within ``device_budget_bytes``.

    Greedy: start with every unit on the host; move, one at a time, the unit whose move to the GPU lowers the
    step time (the largest resource time) the most; stop when no move lowers it.

    Why that suffices: every resource's time is ``fixed`` plus one term per unit, so the step time is the
    maximum of functions linear in which units move. Among units of one kind (a model's blocks, identical in
    size and cost) it is the maximum of linear functions of how many have moved: convex in that count, so the
    first count from which one more move no longer lowers it is the best count. The few distinct units (the
    embedding and head) are candidates at every move, so one moves whenever it lowers the step more than a
    block does; beyond that the search is not exhaustive, which costs little because a move's effect on each
    resource is proportional to the unit's size. A unit is moved only when it strictly lowers the maximum, so
    a step bound by something streaming cannot relieve (GPU compute, NVMe) keeps every unit on the host,
    where it is today.

    Memory: the streamed updates hold their staging sets sized by the largest streamed unit, so the bytes are
    ``max(stream_device_bytes)`` over the streamed units (``UnitCost.stream_device_bytes``): a move that would
    raise that past the budget is not taken. A unit with ``can_stream`` False (moments on NVMe) stays.
    """
    streamed: set[str] = set()
    totals = step_resources(fixed, units, streamed)
    current = max(totals.values())
    held = 0
    while True:
        best: tuple[float, UnitCost] | None = None
        for unit in units:
            if (
                unit.name in streamed
                or not unit.can_stream
                or max(held, unit.stream_device_bytes) > device_budget_bytes
            ):
                continue
            trial = max(totals[r] - unit.host.get(r, 0.0) + unit.streamed.get(r, 0.0) for r in RESOURCES)
            if best is None or trial < best[0]:
                best = (trial, unit)
        if best is None or best[0] >= current * (1 - _EPSILON):
            break
        current, unit = best
        streamed.add(unit.name)
        held = max(held, unit.stream_device_bytes)
        for resource in RESOURCES:
            totals[resource] += unit.streamed.get(resource, 0.0) - unit.host.get(resource, 0.0)
    return tuple(unit.name for unit in units if unit.name in streamed)
