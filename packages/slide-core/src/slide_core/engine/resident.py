"""Units whose fp32 master and optimizer state live on the device: their device buffers, and what they cost.

Beyond the paper: when the GPU has memory to spare beyond the sliding window, the engine keeps whole units
there: a persistent compute-dtype copy, the fp32 master, and Adam's m and v (16 bytes/param with fp32
moments, 12 with bf16 ones, plus 4 for an fp32 accumulator when the unit receives several gradient
contributions per step). Such a unit never
crosses PCIe and is updated on the device in a millisecond, which takes its bytes off the host's memory
bus: the resource that limits speed on fast GPUs. The embedding is the natural first candidate: it is the
largest unit and the last one updated before the next forward needs it. How they are updated is
resident_pipeline.py. The device master is fp32 whatever ``HostParameters.master_format`` is: the host
copy is decoded on the way in and encoded on the way back (both exact).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from slide_core.device import Device
from slide_core.host_params import HostParameters
from slide_core.optim.state_formats import StateArray
from slide_core.unit import SlideModel, Unit

from .slots import ParamSlot

__all__ = ["ResidentUnit", "ResidentUnits", "resident_bytes", "resident_bytes_per_param", "resident_numel_bytes"]

_COPY_NUMEL = 1 << 24
"""Elements of a master copied to the device at a time: bounds the host copy a split master decodes into."""


def resident_bytes_per_param(compute_bytes: int, *, accumulates: bool) -> int:
    """Params + grads in the compute dtype, fp32 master, fp32 m and v, and an fp32 accumulator when the
    unit gets several gradient contributions per step (accumulation, or clipping's rollback)."""
    return 2 * compute_bytes + 12 + (4 if accumulates else 0)


def resident_numel_bytes(
    numel: int, compute_bytes: int, *, accumulates: bool, state_arrays: Sequence[StateArray] | None = None
) -> int:
    """Device bytes :class:`ResidentUnits` allocates for a unit of ``numel``: params + grads in the compute
    dtype, the fp32 master, each of the optimizer's ``state_arrays`` as stored (None: fp32 m and v; bf16
    or int8 moments take 2 or ~1 byte each), and the fp32 accumulator when ``accumulates``."""
    if state_arrays is None:
        return numel * resident_bytes_per_param(compute_bytes, accumulates=accumulates)
    state = sum(array.numel(numel) * array.dtype.itemsize for array in state_arrays)
    return numel * (2 * compute_bytes + 4 + (4 if accumulates else 0)) + state


def resident_bytes(
    unit: Unit, compute_dtype: torch.dtype, *, accumulates: bool, state_arrays: Sequence[StateArray] | None = None
) -> int:
    """Device bytes a unit costs when resident (see :func:`resident_numel_bytes`)."""
    element = torch.empty((), dtype=compute_dtype).element_size()
    return resident_numel_bytes(unit.layout.numel, element, accumulates=accumulates, state_arrays=state_arrays)


@dataclass
class ResidentUnit:
    unit: Unit
    slot: ParamSlot
    master: torch.Tensor
    state: dict[str, torch.Tensor]
    accum: torch.Tensor | None


class ResidentUnits:
    """The device buffers of the device-resident units of one engine."""

    def __init__(
        self,
        model: SlideModel,
        names: tuple[str, ...],
        device: Device,
        host_params: HostParameters,
        host_state: Mapping[str, Mapping[str, torch.Tensor] | None],
        state_names: Sequence[str | StateArray],
        compute_dtype: torch.dtype,
    ) -> None:
        """``host_state``: per unit, host views of its optimizer state to start from (None: a fresh run,
        whose host copy was never written)."""
        by_name = {unit.name: unit for unit in model.units}
        unknown = [name for name in names if name not in by_name]
        if unknown:
            raise ValueError(f"resident_units names unknown units: {', '.join(unknown)}")
        self.device = device
        self.host_params = host_params
        self.units: dict[str, ResidentUnit] = {}
        for index, name in enumerate(names):
            unit = by_name[name]
            numel = unit.layout.numel
            master = device.empty(numel, torch.float32)
            for lo in range(0, numel, _COPY_NUMEL):  # a split master decodes piece by piece on the host
                _upload(device, master[lo : lo + _COPY_NUMEL], host_params.read(unit, lo, lo + _COPY_NUMEL))
            state = {}
            views = host_state[name]
            for array in (a if isinstance(a, StateArray) else StateArray(a) for a in state_names):
                key = array.name
                state[key] = device.empty(array.numel(numel), array.dtype)
                if views is None:
                    state[key].zero_()
                else:
                    for lo in range(0, state[key].numel(), _COPY_NUMEL):
                        _upload(device, state[key][lo : lo + _COPY_NUMEL], views[key][lo : lo + _COPY_NUMEL])
            params = device.empty(numel, compute_dtype)
            params.copy_(master)
            grads = device.empty(numel, compute_dtype)
            grads.zero_()
            slot = ParamSlot(-1 - index, params, grads, unit=unit)
            self.units[name] = ResidentUnit(unit, slot, master, state, None)

    def __contains__(self, name: object) -> bool:
        return name in self.units

    def slot(self, name: str) -> ParamSlot:
        return self.units[name].slot

    def accumulator(self, name: str) -> torch.Tensor:
        """The unit's fp32 gradient accumulator, allocated at its first use and kept for every later step."""
        resident = self.units[name]
        if resident.accum is None:
            resident.accum = self.device.empty(resident.unit.layout.numel, torch.float32)
        return resident.accum

    @property
    def device_bytes(self) -> int:
        total = 0
        for resident in self.units.values():
            tensors = [resident.master, resident.slot.params, resident.slot.grads, *resident.state.values()]
            if resident.accum is not None:
                tensors.append(resident.accum)
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def sync_to_host(self, host_state: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> None:
        """Copy device masters back to the host slab (drain, export) and, given ``host_state``, the
        optimizer state too (checkpoints only: it touches 8 bytes/param of host pages)."""
        for name, resident in self.units.items():
            self.host_params.write(name, resident.master)
            if host_state is not None:
                for key, tensor in resident.state.items():
                    host_state[name][key].copy_(tensor)


def _upload(device: Device, target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy a host piece of a unit into its device buffer through ``Device.copy_to_device``, so a device
    plugin's transfer policy applies (slide_rocm refuses pageable sources): a piece that is not pinned
    (a slab the OS may page, a split master's decoded copy) is pinned first. Engine start only. On the
    CPU device it is a plain copy, with no allocation."""
    if device.is_accelerator and not source.is_pinned():
        source = source.pin_memory()
    device.copy_to_device(target, source, "compute")
    device.synchronize()  # note: CPU-GPU sync point (engine start only): ``source`` may be a temporary
