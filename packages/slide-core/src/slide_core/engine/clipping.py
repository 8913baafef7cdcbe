"""Exact global gradient-norm clipping: the arithmetic and the records of one step.

``torch.nn.utils.clip_grad_norm_`` scales every gradient of a step by ``c = min(1, max_norm / (norm +
1e-6))`` over *all* parameters' final gradients, which exist only once the last backward is done; the
engine updates each unit long before that. So it applies each unit's update with the largest coefficient
the unit's own norm allows (``c_u``), or holds it, and makes it exact once ``c`` is known. How, and the
orderings that keep it safe, are in docs/design/engine.md ("Clipping": Notes [Speculative non-finite
guard], [Early clipping decision], [Deferred clipped steps], [Clip rollback ordering]); the strategies that
do it are in clip_strategy.py; an optimizer takes part through ``Optimizer.correct``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from slide_core.optim.adamw_correction import AdamWCorrection
from slide_core.optimizer import Coefficient, Correction, scale_into

__all__ = [
    "CLIP_EPS",
    "AdamWCorrection",
    "AppliedRange",
    "Coefficient",
    "Correction",
    "ScaledGrads",
    "clip_coefficient",
    "scale_into",
    "unit_coefficient",
]

CLIP_EPS = 1e-6
"""``clip_grad_norm_``'s epsilon in ``max_norm / (total_norm + eps)``."""


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``clip_grad_norm_``'s coefficient before clamping to 1 (so ``< 1`` means 'clip')."""
    return max_norm / (total_norm + CLIP_EPS)


def unit_coefficient(squared_norm: float, max_norm: float) -> float:
    """The speculative coefficient ``c_u`` of a unit with squared gradient norm ``squared_norm``."""
    return min(1.0, clip_coefficient(math.sqrt(squared_norm), max_norm))


class ScaledGrads:
    """fp32 scratch, per device, for ``coeff * grad`` ranges. One instance per thread."""

    def __init__(self) -> None:
        self._held: dict[torch.device, torch.Tensor] = {}

    def __call__(self, grad: torch.Tensor, coeff: Coefficient) -> torch.Tensor:
        if isinstance(coeff, float) and coeff == 1.0:
            return grad
        held = self._held.get(grad.device)
        if held is None or held.numel() < grad.numel():
            held = self._held[grad.device] = torch.empty(grad.numel(), dtype=torch.float32, device=grad.device)
        return scale_into(held[: grad.numel()], grad, coeff)


@dataclass(frozen=True)
class AppliedRange:
    """One range ``[start, end)`` of a host unit's final gradient: applied (or, in a deferred step, to be
    applied) as ``coeff * grad``."""

    start: int
    end: int
    grad: torch.Tensor  # a view of the grad store or of the unit's fp32 accumulator
    decay: bool
    coeff: float
