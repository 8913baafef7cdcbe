"""Learning-rate schedules with linear warmup, matching transformers' schedulers step for step.

``step`` counts optimizer steps from 0, as HF's ``LambdaLR`` does: the first update uses ``lr_at(0)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SCHEDULES", "LRSchedule"]

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    base_lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.kind!r}; expected one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if self.base_lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.base_lr}")

    def factor(self, step: int) -> float:
        """Multiplier of ``base_lr`` at 0-based optimizer step ``step``."""
        if step < self.warmup_steps:
            return float(step) / float(max(1, self.warmup_steps))
        if self.kind == "constant":
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        if self.kind == "linear":
            return max(0.0, float(self.total_steps - step) / float(decay_steps))
        progress = float(step - self.warmup_steps) / float(decay_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    def lr_at(self, step: int) -> float:
        return self.base_lr * self.factor(step)
