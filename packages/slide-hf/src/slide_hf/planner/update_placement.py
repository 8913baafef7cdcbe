"""Which units to update on the GPU as they stream, from each unit's measured costs: a pure function.

A host-updated unit costs PCIe d2h (its gradient), host memory and CPU time (the host AdamW); a
GPU-streamed one costs PCIe both ways (master and moments travel with it) and GPU time (its update) instead.
Which is cheaper for the step depends on which resource binds: a machine whose host optimizer is the
bottleneck gains by streaming units until PCIe or the GPU binds; one whose GPU binds gains nothing.
:func:`choose_streamed_units` makes that choice; slide_hf/planner/plan.py feeds it the costs of
slide_hf/planner/unit_costs.py and the GPU memory a plan leaves spare.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from slide_hf.planner.unit_costs import RESOURCES, StagingPrice, UnitCost, resource_times

__all__ = ["choose_streamed_units", "step_resources", "streaming_order"]

_EPSILON = 1e-9
"""A move must lower the step time by more than this fraction: float noise is not a gain."""


def step_resources(fixed: Mapping[str, float], units: Sequence[UnitCost], streamed: set[str]) -> dict[str, float]:
    """Seconds per step of each resource when the units in ``streamed`` are GPU-streamed and the rest of
    ``units`` host-updated; ``fixed`` holds everything else (compute, the stash, resident units)."""
    return resource_times(fixed, units, {unit.name: "streamed" for unit in units if unit.name in streamed})


def choose_streamed_units(
    fixed: Mapping[str, float],
    units: Sequence[UnitCost],
    device_budget_bytes: int,
    staging_bytes: StagingPrice | None = None,
) -> tuple[str, ...]:
    """The units of ``units`` to GPU-stream (in ``units``' order) so that the step's largest resource time
    is smallest, with the streamed updates' GPU memory within ``device_budget_bytes``: the moves of
    :func:`streaming_order` for as long as each lowers it.

    Why stopping there suffices: every resource's time is ``fixed`` plus one term per unit, so the step time
    is the maximum of functions linear in which units move. Among units of one kind (a model's blocks,
    identical in size and cost) it is the maximum of linear functions of how many have moved: convex in that
    count, so the first count from which one more move no longer lowers it is the best count. A unit is moved
    only when it strictly lowers the maximum, so a step bound by something streaming cannot relieve (GPU
    compute, NVMe) keeps every unit on the host."""
    streamed: set[str] = set()
    totals = step_resources(fixed, units, streamed)
    current = max(totals.values())
    for name, step_s in streaming_order(fixed, units, device_budget_bytes, staging_bytes):
        if step_s >= current * (1 - _EPSILON):
            break
        streamed.add(name)
        current = step_s
    return tuple(unit.name for unit in units if unit.name in streamed)


def streaming_order(
    fixed: Mapping[str, float],
    units: Sequence[UnitCost],
    device_budget_bytes: int,
    staging_bytes: StagingPrice | None = None,
) -> tuple[tuple[str, float], ...]:
    """Every unit that may stream, in the order a greedy search moves them to the GPU, each with the step's
    largest resource time once it has moved: start with every unit on the host; move, one at a time, the
    unit whose move leaves the smallest largest resource time, whether or not it lowers it, until none is
    left that may move. The plan weighs the prefixes of this order by the step time of the engine's order
    (slide_hf/planner/step_schedule.py), which no sum of terms gives.

    The few distinct units (the embedding and head) are candidates at every move, so one moves whenever it
    helps more than a block does; beyond that the search is not exhaustive, which costs little because a
    move's effect on each resource is proportional to the unit's size.

    Memory: a move that would raise the GPU bytes of streaming the moved units, ``staging_bytes`` of them
    (the plan's :func:`~slide_hf.planner.unit_costs.staging_price`: staging sets sized by the largest, and a
    summed gradient per summing unit in flight), past the budget is not taken; without it, the largest
    ``UnitCost.stream_device_bytes`` of them. A unit with ``can_stream`` False (moments on NVMe) stays."""
    price = staging_bytes if staging_bytes is not None else _largest_of(units)
    streamed: set[str] = set()
    totals = step_resources(fixed, units, streamed)
    order: list[tuple[str, float]] = []
    while True:
        best: tuple[float, UnitCost] | None = None
        for unit in units:
            if unit.name in streamed or not unit.can_stream or price([*streamed, unit.name]) > device_budget_bytes:
                continue
            trial = max(totals[r] - unit.host.get(r, 0.0) + unit.streamed.get(r, 0.0) for r in RESOURCES)
            if best is None or trial < best[0]:
                best = (trial, unit)
        if best is None:
            return tuple(order)
        step_s, unit = best
        streamed.add(unit.name)
        order.append((unit.name, step_s))
        for resource in RESOURCES:
            totals[resource] += unit.streamed.get(resource, 0.0) - unit.host.get(resource, 0.0)


def _largest_of(units: Sequence[UnitCost]) -> StagingPrice:
    """The largest ``stream_device_bytes`` of the units named: the GPU bytes of streaming them where those
    are the staging of the largest alone."""
    by_name = {unit.name: unit.stream_device_bytes for unit in units}

    def price(names: Iterable[str]) -> int:
        return max((by_name[name] for name in names), default=0)

    return price
