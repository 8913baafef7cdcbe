"""Units whose fp32 master and optimizer state live on the device.

Beyond the paper: when the GPU has memory to spare beyond the sliding window, the engine keeps whole units
there: a persistent compute-dtype copy, the fp32 master, and Adam's m and v (16 bytes/param, plus 4 for an
fp32 accumulator when the unit receives several gradient contributions per step). Such a unit never
crosses PCIe and is updated on the device in a millisecond, which takes its bytes off the host's memory
bus: the resource that limits speed on fast GPUs. The embedding is the natural first candidate: it is the
largest unit and the last one updated before the next forward needs it.

Note [Tied gradient in the slot]: with one micro-batch per step (clipping on or off), the only resident unit
that receives two gradient contributions is a tied embedding (the head's share, then its own). Its
slot's gradient buffer then accumulates both (the second is added in place), instead of an fp32
accumulator of 4 bytes/param: that is what lets a 128K-vocabulary embedding fit a 12 GiB budget. In bf16
the sum is rounded once more than plain PyTorch's fp32 ``.grad`` accumulation; in fp32 it is the same
sum. Tested by ``test_device_resident_units_match`` (tied cases).

Note [Resident update ordering]: the update runs on the compute stream right after the unit's backward,
so stream order alone makes every later read of the unit's parameters see the new values. The host copy
of the master is refreshed only in :meth:`ResidentUnits.sync_to_host` (drain, checkpoint, export).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from slide_core.device import Device
from slide_core.host_params import HostParameters
from slide_core.optimizer import Optimizer
from slide_core.unit import SlideModel, Unit

from .slots import ParamSlot

__all__ = ["ResidentUnit", "ResidentUnits", "resident_bytes", "resident_bytes_per_param"]


def resident_bytes_per_param(compute_bytes: int, *, accumulates: bool) -> int:
    """Params + grads in the compute dtype, fp32 master, m and v, and an fp32 accumulator when the unit
    gets several gradient contributions per step (accumulation, or clipping's rollback)."""
    return 2 * compute_bytes + 12 + (4 if accumulates else 0)


def resident_bytes(unit: Unit, compute_dtype: torch.dtype, *, accumulates: bool) -> int:
    """Device bytes a unit costs when resident (see :func:`resident_bytes_per_param`)."""
    element = torch.empty((), dtype=compute_dtype).element_size()
    return unit.layout.numel * resident_bytes_per_param(element, accumulates=accumulates)


@dataclass
class ResidentUnit:
    unit: Unit
    slot: ParamSlot
    master: torch.Tensor
    state: dict[str, torch.Tensor]
    accum: torch.Tensor | None


class ResidentUnits:
    """The device-resident units of one engine, and their on-device updates."""

    def __init__(
        self,
        model: SlideModel,
        names: tuple[str, ...],
        device: Device,
        host_params: HostParameters,
        host_state: Mapping[str, Mapping[str, torch.Tensor] | None],
        optimizer: Optimizer,
        compute_dtype: torch.dtype,
        chunk_numel: int,
    ) -> None:
        by_name = {unit.name: unit for unit in model.units}
        unknown = [name for name in names if name not in by_name]
        if unknown:
            raise ValueError(f"resident_units names unknown units: {', '.join(unknown)}")
        self.device = device
        self.host_params = host_params
        self.optimizer = optimizer
        self.chunk_numel = chunk_numel  # bounds the optimizer's fp32 scratch for low-precision grads
        self.units: dict[str, ResidentUnit] = {}
        for index, name in enumerate(names):
            unit = by_name[name]
            numel = unit.layout.numel
            master = device.empty(numel, torch.float32)
            master.copy_(host_params.flat(unit))
            state = {}
            views = host_state[name]
            for key in optimizer.state_names:
                state[key] = device.empty(numel, torch.float32)
                if views is None:  # a fresh run: the host copy was never written
                    state[key].zero_()
                else:
                    state[key].copy_(views[key])
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

    @property
    def device_bytes(self) -> int:
        total = 0
        for resident in self.units.values():
            tensors = [resident.master, resident.slot.params, resident.slot.grads, *resident.state.values()]
            if resident.accum is not None:
                tensors.append(resident.accum)
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def apply(self, name: str, mode: str, lr: float, step: int, *, in_slot: bool = False) -> None:
        """Consume the gradient in the unit's slot (see GradChunk modes), on the current (compute) stream.

        ``in_slot``: contributions are summed in the slot's own gradient buffer (Note [Tied gradient in
        the slot]); the update runs on the last one.
        """
        resident = self.units[name]
        grads = resident.slot.grads
        if in_slot and mode in ("stash", "add"):
            return
        if in_slot and mode == "add_step":
            mode = "step"
        if mode == "stash":
            if resident.accum is None:  # first accumulation only; reused by every later step
                resident.accum = self.device.empty(grads.numel(), torch.float32)
            resident.accum.copy_(grads)
            return
        if mode in ("add", "add_step"):
            resident.accum.add_(grads)
            if mode == "add":
                return
            grads = resident.accum
        decay_numel = resident.unit.layout.decay_numel
        numel = resident.unit.layout.numel
        for start, end, decay in ((0, decay_numel, True), (decay_numel, numel, False)):
            if end > start:
                state = {key: view[start:end] for key, view in resident.state.items()}
                self.optimizer.step(resident.master[start:end], grads[start:end], state, lr=lr, step=step, decay=decay)
        resident.slot.params.copy_(resident.master)

    def refresh_params(self) -> None:
        """Recompute each unit's compute-dtype copy from its master (after a resume wrote the masters)."""
        for resident in self.units.values():
            resident.slot.params.copy_(resident.master)

    def sync_to_host(self, host_state: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> None:
        """Copy device masters back to the host slab (drain, export) and, given ``host_state``, the
        optimizer state too (checkpoints only: it touches 8 bytes/param of host pages)."""
        for name, resident in self.units.items():
            self.host_params.flat(name).copy_(resident.master)
            if host_state is not None:
                for key, tensor in resident.state.items():
                    host_state[name][key].copy_(tensor)
