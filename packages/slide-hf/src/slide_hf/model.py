"""Where every checkpoint tensor lives in a :class:`SlideModel`: shared by loading, export and init.

Loading and export walk the same list, so a key the loader reads is exactly a key the exporter writes.
Kept free of transformers imports: it only reads the ``checkpoint_names`` / ``checkpoint_slices`` that
adapter units carry.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from slide_core.host_params import HostParameters
from slide_core.unit import SlideModel, Unit

__all__ = ["CheckpointEntry", "checkpoint_entries", "param_count", "unit_views"]


@dataclass(frozen=True)
class CheckpointEntry:
    """One tensor of an HF checkpoint: stored under ``key``, it is ``view(param)[index]`` of ``unit``.

    With ``source`` the entry is only the region ``source`` of the stored tensor (of ``stored_shape``),
    whose other regions are other entries under the same key, usually of other units (a checkpoint
    tensor split across blocks); see ``CheckpointSlice.source`` in slide_hf/adapters/base.py.
    """

    key: str
    unit: Unit
    param: str
    index: tuple[Any, ...] = ()
    source: tuple[slice, ...] = ()
    stored_shape: tuple[int, ...] = ()

    def target(self, views: dict[str, torch.Tensor]) -> torch.Tensor:
        """The region of the unit's views (from :meth:`HostParameters.views`) this entry covers."""
        view = views[self.param]
        return view[self.index] if self.index else view


def checkpoint_entries(model: SlideModel) -> list[CheckpointEntry]:
    """Every checkpoint tensor of ``model``, in unit and layout order.

    Borrowed (tied) parameters are not listed: they belong to the embedding, and HF checkpoints store a
    tied matrix once, under the embedding's key.
    """
    return list(_iter_entries(model))


def _iter_entries(model: SlideModel) -> Iterator[CheckpointEntry]:
    for unit in model.units:
        names: dict[str, str] | None = getattr(unit, "checkpoint_names", None)
        if names is None:
            raise TypeError(f"unit {unit.name!r} has no checkpoint_names; it was not built by a slide-hf adapter")
        slices = getattr(unit, "checkpoint_slices", {})
        for spec in unit.layout:
            if spec.name in slices:
                for piece in slices[spec.name]:
                    source, stored = getattr(piece, "source", ()), getattr(piece, "stored_shape", ())
                    yield CheckpointEntry(piece.key, unit, spec.name, piece.index, source, stored)
            else:
                yield CheckpointEntry(names[spec.name], unit, spec.name)


def param_count(model: SlideModel) -> int:
    """Parameters of ``model`` without alignment padding; a tied matrix counts once and checkpoint buffers
    carried in the layout not at all (as HF counts; Note [Buffers carried as parameters] in
    slide_hf/adapters/base.py)."""
    carried = sum(unit.layout[name].numel for unit in model.units for name in getattr(unit, "buffer_params", ()))
    return sum(unit.layout.param_numel for unit in model.units) - carried


def unit_views(host_params: HostParameters) -> Mapping[str, dict[str, torch.Tensor]]:
    """``unit name -> (param -> fp32 view)`` for every unit, for reading the model in unit order (export):
    the slab's own views of an fp32 master, one decoded unit at a time of a split one
    (:meth:`HostParameters.unit_views`). Writers go through :meth:`HostParameters.editing`."""
    return host_params.unit_views()
