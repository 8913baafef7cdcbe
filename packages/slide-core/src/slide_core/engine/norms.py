"""Per-unit squared gradient norms, formed on the device where each unit's gradient is.

See Note [Gradient norm of every step] in docs/design/engine.md: what is summed where, and when the main
thread reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from slide_core.allocation_ledger import AllocationLedger
from slide_core.device import Device
from slide_core.unit import Unit

from .clipping import CLIP_EPS
from .config import EngineConfig

__all__ = ["UnitNorms"]


class UnitNorms:
    """Per-unit squared gradient norms: fp32 on the device, and a pinned host copy of each.

    The device slot of a unit sums the squared norms of the unit's gradient contributions of the step (for
    a unit with one contribution, and for a resident unit's final gradient, that is the squared norm of
    the gradient; a host unit with several holds only a finiteness check, its final gradient's norm is
    summed on the host). The main thread reads every slot with the step's loss. The host copy is sent
    once per step, with the unit's final contribution, on the d2h stream ahead of its chunks. ``coeffs``
    holds resident units' device-side ``c_u``.
    """

    def __init__(self, device: Device, units: Sequence[Unit], *, ledger: AllocationLedger | None = None) -> None:
        """``ledger``: the engine's, which counts the pinned host copy."""
        self._index = {unit.name: index for index, unit in enumerate(units)}
        self.on_device = device.empty(len(units), torch.float32)
        self.on_device.zero_()
        on_host = device.alloc_pinned(len(units), torch.float32)
        self.on_host = (ledger or AllocationLedger()).record(self, "grad_norms", on_host)
        self.on_host.zero_()
        self.coeffs = device.empty(len(units), torch.float32)
        self.coeffs.fill_(1.0)

    @staticmethod
    def wanted(config: EngineConfig) -> bool:
        """Whether an engine of ``config`` keeps per-unit norms: for clipping, for the non-finite check
        and for the reported norm (the planner prices them only then)."""
        return config.clipping or config.skip_nonfinite or config.report_grad_norm

    @staticmethod
    def device_bytes_for(num_units: int) -> int:
        """Device bytes: one fp32 squared norm and one fp32 coefficient per unit."""
        return 2 * num_units * torch.float32.itemsize

    @staticmethod
    def host_bytes_for(num_units: int) -> int:
        """Pinned host bytes: the host copy of every unit's fp32 squared norm."""
        return num_units * torch.float32.itemsize

    def add(self, unit: Unit, grad: torch.Tensor, *, first: bool) -> torch.Tensor:
        """Compute stream: fold ``|grad|^2`` into the unit's device slot; return that 0-dim slot."""
        squared = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        slot = self.on_device[self._index[unit.name]]
        if first:
            slot.copy_(squared)
        else:
            slot.add_(squared)
        return slot

    @staticmethod
    def summed_square(grad: torch.Tensor, ranges: Iterable[tuple[int, int]]) -> torch.Tensor:
        """Compute stream: the squared norm of a summed gradient as the host optimizer thread sums it
        (``ClipStrategy._add_square`` over the ranges its chunks land in): each range's fp32 norm squared
        in fp64, added in order to 0. A 0-dim fp64 device tensor, the same float as the host's sum of the
        same values (Note [Streamed accumulation] in streamed_pipeline.py); ``ranges`` index ``grad``."""
        total = torch.zeros((), dtype=torch.float64, device=grad.device)
        for start, end in ranges:
            total.add_(torch.linalg.vector_norm(grad[start:end], dtype=torch.float32).double().square())
        return total

    def device_coefficient(self, unit: Unit, squared: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Compute stream: ``c_u`` as a 0-dim device tensor (1 where the norm is not finite: the
        gradient was zeroed, see Note [Speculative non-finite guard]).

        Formed in fp64 as ``clipping.unit_coefficient`` forms it in Python from the same fp32 square
        (a correctly rounded square root, sum and quotient), then rounded to fp32 as a ``grad_scale``
        is: the host reads it back as that float, bit for bit, to correct a GPU-streamed unit
        (Note [Streamed speculation] in streamed_pipeline.py)."""
        denominator = squared.double().sqrt().add_(CLIP_EPS)
        coeff = torch.full_like(denominator, max_norm).div_(denominator).clamp_(max=1.0)
        slot = self.coeffs[self._index[unit.name]]
        slot.copy_(torch.where(torch.isfinite(squared), coeff, torch.ones_like(coeff)))
        return slot

    def coefficient(self, unit: Unit) -> torch.Tensor:
        """The resident unit's device-side ``c_u`` of this step (as its speculative update applied it)."""
        return self.coeffs[self._index[unit.name]]

    def send(self, unit: Unit) -> torch.Tensor:
        """d2h stream: start copying the unit's squared norm to the host; return the pinned 0-dim view."""
        index = self._index[unit.name]
        host = self.on_host[index]
        host.copy_(self.on_device[index], non_blocking=True)
        return host
