"""The Optimizer interface: step one flat range of one unit's fp32 master given its gradients.

The engine hands the optimizer *ranges* of a unit's flat buffer as gradient chunks land on the host, so
the update can start before the whole unit's gradients have arrived. Every range lies entirely inside the
unit's decay prefix or entirely after it, so an optimizer never splits a call by parameter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["AdamWConfig", "Optimizer"]


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyperparameters, with torch.optim.AdamW's defaults except weight decay (HF's 0.0)."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta1 < 1.0:
            raise ValueError(f"adam beta1 must be in [0, 1), got {self.beta1}")
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"adam beta2 must be in [0, 1), got {self.beta2}")
        if self.eps <= 0.0:
            raise ValueError(f"adam eps must be > 0, got {self.eps}")
        if self.weight_decay < 0.0:
            raise ValueError(f"weight decay must be >= 0, got {self.weight_decay}")


class Optimizer(ABC):
    """Updates flat fp32 ranges in place. One instance serves one engine and is used from one thread."""

    state_names: tuple[str, ...] = ()
    """Names of the per-element fp32 state tensors (e.g. ``exp_avg``, ``exp_avg_sq``)."""

    def __init__(self, config: AdamWConfig) -> None:
        self.config = config

    def reserve(self, max_range_numel: int) -> None:  # noqa: B027 - optional hook
        """Preallocate scratch for ranges up to ``max_range_numel`` so ``step`` never allocates."""

    @abstractmethod
    def step(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float = 1.0,
    ) -> None:
        """Apply one update to ``master`` (fp32, flat) in place.

        ``grad`` has the same numel in any float dtype and is never written; ``state`` holds the matching
        ranges of this optimizer's state tensors; ``step`` is the 1-based update count used for bias
        correction; ``decay`` says whether weight decay applies to this range.

        The update applies ``grad_scale * grad``, the product formed in fp32 exactly as ``grad.float() *
        float32(grad_scale)`` (one rounding), i.e. bit for bit what ``slide_core.engine.clipping.scale_into``
        produces: clipping's correction recomputes that product and relies on the match. It exists so that a
        fused optimizer can scale in registers instead of in an extra pass over memory.
        """
