"""The fp32 master weights of every unit, in one host slab.

Loaders write into these views; the engine's optimizer updates them; exporters read them. One slab means
one pinning call (no per-tensor ``pin_memory``) and one contiguous range per unit, which is what the
host-to-device copy and the flat optimizer want.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from slide_core.unit import SlideModel, Unit

__all__ = ["HostParameters"]

Allocator = Callable[[int, torch.dtype], torch.Tensor]


def _plain_alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


class HostParameters:
    """fp32 master copy of a :class:`SlideModel`'s parameters.

    ``alloc`` decides where the slab lives. The default, pageable memory, is what training uses: the engine
    pins the ranges it streams and gives back the pages of device-resident units (Note [Resident host
    copies]); ``device.alloc_pinned`` pins the whole slab up front instead. Every unit has its range,
    device-resident ones included: loaders fill it and exporters read it.
    """

    def __init__(self, model: SlideModel, alloc: Allocator = _plain_alloc) -> None:
        self.model = model
        self._offsets: dict[str, tuple[int, int]] = {}
        total = 0
        for unit in model.units:
            self._offsets[unit.name] = (total, unit.layout.numel)
            total += unit.layout.numel
        self.numel = total
        self.slab = alloc(total, torch.float32)
        # Alignment padding is never read by a unit; keep it finite so whole-slab operations stay clean.
        for unit in model.units:
            flat = self.flat(unit)
            for start, end in _gaps(unit):
                flat[start:end].zero_()

    def flat(self, unit: Unit | str) -> torch.Tensor:
        name = unit if isinstance(unit, str) else unit.name
        start, numel = self._offsets[name]
        return self.slab[start : start + numel]

    def span(self, first: Unit | str, last: Unit | str) -> torch.Tensor:
        """The slab from ``first``'s range to the end of ``last``'s (units are laid out in model order)."""
        start = self._offsets[first if isinstance(first, str) else first.name][0]
        end = sum(self._offsets[last if isinstance(last, str) else last.name])
        return self.slab[start:end]

    def views(self, unit: Unit | str) -> dict[str, torch.Tensor]:
        unit = self._unit(unit)
        return unit.layout.views(self.flat(unit))

    def named_tensors(self) -> Iterator[tuple[Unit, str, torch.Tensor]]:
        for unit in self.model.units:
            for name, tensor in self.views(unit).items():
                yield unit, name, tensor

    def _unit(self, unit: Unit | str) -> Unit:
        if isinstance(unit, Unit):
            return unit
        for candidate in self.model.units:
            if candidate.name == unit:
                return candidate
        raise KeyError(f"no unit named {unit!r}")

    @property
    def nbytes(self) -> int:
        return self.slab.numel() * self.slab.element_size()


def _gaps(unit: Unit) -> list[tuple[int, int]]:
    gaps = []
    cursor = 0
    for spec in unit.layout:
        if spec.offset > cursor:
            gaps.append((cursor, spec.offset))
        cursor = spec.offset + spec.numel
    if cursor < unit.layout.numel:
        gaps.append((cursor, unit.layout.numel))
    return gaps
