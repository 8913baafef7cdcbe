"""Which units live on the device: spend spare GPU memory where it saves the most host work.

The order is by what residency buys. The embedding first: it is usually the largest unit and it is
updated last in backward, right before the next forward needs it, so its host update is the step-boundary
bubble. Then the head (large, and its update can start at once on the GPU). Then blocks from the first
one on: the first blocks are updated last, so they too sit closest to the boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slide_core.optim.state_formats import StateArray
from slide_core.unit import SlideModel, Unit

from .resident import resident_bytes

__all__ = ["choose_resident_units"]


def _window_bytes_saved(unit: Unit, model: SlideModel, compute_dtype: torch.dtype) -> int:
    """An embedding or head that becomes resident no longer needs its own sliding slot."""
    if unit is model.embedding or unit is model.head:
        element = torch.empty((), dtype=compute_dtype).element_size()
        return 2 * unit.layout.numel * element
    return 0


def choose_resident_units(
    model: SlideModel,
    budget_bytes: int,
    compute_dtype: torch.dtype,
    *,
    accumulates: bool,
    state_arrays: Sequence[StateArray] | None = None,
) -> tuple[str, ...]:
    """Names of the units to keep on the device within ``budget_bytes`` of spare memory (greedy), each
    priced with the optimizer's ``state_arrays`` (None: fp32 m and v)."""
    order = [model.embedding, model.head, *model.blocks]
    chosen: list[str] = []
    left = budget_bytes
    for unit in order:
        # ``accumulates``: gradient accumulation; otherwise a tied embedding sums its two
        # contributions in its slot (Note [Tied gradient in the slot] in docs/design/engine.md).
        cost = resident_bytes(unit, compute_dtype, accumulates=accumulates, state_arrays=state_arrays)
        cost -= _window_bytes_saved(unit, model, compute_dtype)
        if cost > left:
            if unit in (model.embedding, model.head):
                continue  # a large edge unit may not fit where blocks still do
            break
        chosen.append(unit.name)
        left -= cost
    return tuple(chosen)
