"""Learning-rate schedules with linear warmup, matching transformers' schedulers step for step.

``step`` counts optimizer steps from 0, as HF's ``LambdaLR`` does: the first update uses ``lr_at(0)``.

After the warmup the lr decays from the peak ``base_lr`` to a floor, ``min_lr_ratio x base_lr`` (0 by
default, which gives transformers' linear and cosine schedules exactly):

- ``constant``: the peak throughout (no decay, so no floor);
- ``linear`` and ``cosine``: over every step after the warmup;
- ``wsd`` (warmup-stable-decay): the peak until the last ``decay_fraction`` of the run, then a
  ``decay_shape`` (linear or cosine) tail to the floor.

A run that goes on longer than planned (``slide train --resume --extend-schedule``) must not jump back up
its curve, so :meth:`LRSchedule.extend` keeps every step before the resume point as it was and fits the
rest of the curve, starting from the lr the old curve had there, to the new length (the same shape, down
to the same floor). Each extension is recorded, so the whole curve is rebuilt from :meth:`to_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["DECAY_SHAPES", "SCHEDULES", "LRSchedule"]

SCHEDULES = ("constant", "linear", "cosine", "wsd")
DECAY_SHAPES = ("linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """``base_lr`` is the peak. ``extensions`` lists ``(at_step, total_steps)``: from ``at_step`` on, the
    curve was refitted to end at ``total_steps`` (see :meth:`extend`)."""

    base_lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    min_lr_ratio: float = 0.0
    decay_fraction: float = 0.1
    decay_shape: str = "linear"
    extensions: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.kind!r}; expected one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if self.base_lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.base_lr}")
        if not 0.0 <= self.min_lr_ratio < 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1), got {self.min_lr_ratio}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ValueError(f"decay_shape must be one of {', '.join(DECAY_SHAPES)}, got {self.decay_shape!r}")
        previous = self.total_steps
        for at_step, total in self.extensions:
            if not (self.warmup_steps <= at_step <= min(previous, total)):
                raise ValueError(f"extension {(at_step, total)} does not follow a schedule of {previous} steps")
            previous = total

    @property
    def final_steps(self) -> int:
        """The step count the schedule ends at now: the last extension's, else ``total_steps``."""
        return self.extensions[-1][1] if self.extensions else self.total_steps

    def lr_at(self, step: int) -> float:
        """The lr of 0-based optimizer step ``step``."""
        if step < self.warmup_steps:
            return self.base_lr * (float(step) / float(max(1, self.warmup_steps)))
        at, total, start = self.warmup_steps, self.total_steps, self.base_lr
        for ext_at, ext_total in self.extensions:
            if step < ext_at:
                break
            start = self._decay(ext_at, at, total, start)
            at, total = ext_at, ext_total
        return self._decay(step, at, total, start)

    def factor(self, step: int) -> float:
        """Multiplier of ``base_lr`` at 0-based optimizer step ``step``."""
        return self.lr_at(step) / self.base_lr if self.base_lr else 0.0

    def extend(self, at_step: int, total_steps: int) -> LRSchedule:
        """This schedule, continued from ``at_step`` to ``total_steps`` (longer or shorter) without a jump:
        every step before ``at_step`` keeps its lr, and from there the curve's remaining shape runs from the
        lr it had at ``at_step`` down to the floor at ``total_steps``. During the warmup nothing of the decay
        has happened yet, so the schedule is simply planned for ``total_steps``."""
        if total_steps == self.final_steps:
            return self
        if self.kind == "constant" or (not self.extensions and at_step <= self.warmup_steps):
            return replace(self, total_steps=total_steps, extensions=())
        return replace(self, extensions=(*self.extensions, (at_step, total_steps)))

    def _decay(self, step: int, at: int, total: int, start: float) -> float:
        """The lr at ``step`` of a decay that starts at ``start`` at step ``at`` and reaches the floor at
        ``total``. With ``at`` the warmup's end and ``start`` the peak this is the plain schedule, written
        as transformers writes it (so a floor of 0 gives its values bit for bit)."""
        if self.kind == "constant":
            return start
        floor = self.min_lr_ratio * self.base_lr
        if self.kind == "wsd":
            decay_steps = min(max(1, total - at), max(1, math.ceil(self.decay_fraction * total)))
            at = total - decay_steps
            if step < at:
                return start
            shape = self.decay_shape
        else:
            shape = self.kind
        span = float(max(1, total - at))
        if shape == "linear":
            left = max(0.0, float(total - step) / span)
        else:
            progress = min(1.0, float(step - at) / span)
            left = max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        return floor + (start - floor) * left

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, for a checkpoint: :meth:`from_dict` rebuilds the same curve."""
        return {
            "base_lr": self.base_lr,
            "kind": self.kind,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "min_lr_ratio": self.min_lr_ratio,
            "decay_fraction": self.decay_fraction,
            "decay_shape": self.decay_shape,
            "extensions": [list(pair) for pair in self.extensions],
        }

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LRSchedule:
        """The schedule :meth:`to_dict` wrote; ``ValueError``/``TypeError``/``KeyError`` when it is malformed."""
        extensions = tuple((int(a), int(b)) for a, b in values.get("extensions", ()))
        return cls(
            float(values["base_lr"]),
            str(values["kind"]),
            int(values["warmup_steps"]),
            int(values["total_steps"]),
            float(values.get("min_lr_ratio", 0.0)),
            float(values.get("decay_fraction", 0.1)),
            str(values.get("decay_shape", "linear")),
            extensions,
        )
