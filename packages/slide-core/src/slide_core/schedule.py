"""Learning-rate schedules with linear warmup, matching transformers' schedulers step for step.

``step`` counts optimizer steps from 0, as HF's ``LambdaLR`` does: the first update uses ``lr_at(0)``.

After the warmup the lr decays from the peak ``base_lr`` to a floor, ``min_lr_ratio x base_lr`` (0 by
default, which gives transformers' linear and cosine schedules exactly):

- ``constant``: the peak throughout (no decay, so no floor);
- ``linear`` and ``cosine``: over every step after the warmup;
- ``wsd`` (warmup-stable-decay): the peak until the last ``decay_fraction`` of the run, then a
  ``decay_shape`` (linear or cosine) tail to the floor;
- ``cosine_with_restarts``: ``cycles`` cosine decays to the floor, each restarting at the peak
  (transformers' ``get_cosine_with_hard_restarts_schedule_with_warmup``);
- ``polynomial``: ``(1 - progress) ** power`` from the peak down to the absolute ``end_lr``, held after the
  last step (``get_polynomial_decay_schedule_with_warmup``);
- ``inverse_sqrt``: the peak times ``1 / sqrt((step + timescale - warmup) / timescale)``, with no end
  (``get_inverse_sqrt_schedule``; ``timescale`` defaults to the warmup, or 10,000 without one).

Each is written as transformers writes it, so a floor of 0 (and ``end_lr`` for polynomial) gives its
values to the last bit or within a rounding of them.

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

__all__ = ["DECAY_SHAPES", "FLOORED", "SCHEDULES", "LRSchedule", "warmup_from_ratio"]

SCHEDULES = ("constant", "linear", "cosine", "wsd", "cosine_with_restarts", "polynomial", "inverse_sqrt")
DECAY_SHAPES = ("linear", "cosine")
FLOORED = ("linear", "cosine", "wsd", "cosine_with_restarts")
"""The schedules whose floor is ``min_lr_ratio x base_lr`` (polynomial ends at ``end_lr``; constant and
inverse_sqrt have no end to reach)."""
_UNENDING = ("constant", "inverse_sqrt")
"""Schedules that do not depend on the run's length, so extending one only records the new length."""
_DEFAULT_TIMESCALE = 10_000
"""transformers' ``get_inverse_sqrt_schedule`` timescale when there is no warmup to take it from."""


def warmup_from_ratio(total_steps: int, ratio: float) -> int:
    """The warmup steps of ``--warmup-ratio``: ``ceil(total_steps x ratio)``, as the HF Trainer's
    ``get_warmup_steps`` computes them (so the same ratio warms up for the same steps in both)."""
    return math.ceil(total_steps * ratio)


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
    cycles: int = 1
    power: float = 1.0
    end_lr: float = 1e-7
    timescale: int | None = None

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
        if self.cycles < 1:
            raise ValueError(f"cycles must be >= 1, got {self.cycles}")
        if not (math.isfinite(self.power) and self.power > 0):
            raise ValueError(f"power must be > 0, got {self.power}")
        if not (math.isfinite(self.end_lr) and self.end_lr >= 0):
            raise ValueError(f"end_lr must be >= 0, got {self.end_lr}")
        if self.kind == "polynomial" and not self.end_lr < self.base_lr:
            raise ValueError(f"end_lr ({self.end_lr}) must be smaller than the peak lr ({self.base_lr})")
        if self.timescale is not None and self.timescale < 1:
            raise ValueError(f"timescale must be >= 1, got {self.timescale}")
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
        if self.kind == "inverse_sqrt":
            timescale = self.timescale if self.timescale is not None else self.warmup_steps or _DEFAULT_TIMESCALE
            return self.base_lr * (1.0 / math.sqrt((step + (timescale - self.warmup_steps)) / timescale))
        if self.kind == "cosine_with_restarts":
            return self._restarts_at(step)
        at, total, start = self.warmup_steps, self.total_steps, self.base_lr
        for ext_at, ext_total in self.extensions:
            if step < ext_at:
                break
            start = self._decay(ext_at, at, total, start)
            at, total = ext_at, ext_total
        return self._decay(step, at, total, start)

    @property
    def floor_lr(self) -> float:
        """The lr the decay ends at: ``end_lr`` for polynomial, else ``min_lr_ratio x base_lr`` (0 for
        constant and inverse_sqrt, which never reach an end)."""
        if self.kind == "polynomial":
            return self.end_lr
        return self.min_lr_ratio * self.base_lr if self.kind in FLOORED else 0.0

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
        if self.kind in _UNENDING or (not self.extensions and at_step <= self.warmup_steps):
            return replace(self, total_steps=total_steps, extensions=())
        return replace(self, extensions=(*self.extensions, (at_step, total_steps)))

    def _decay(self, step: int, at: int, total: int, start: float) -> float:
        """The lr at ``step`` of a decay that starts at ``start`` at step ``at`` and reaches the floor at
        ``total``. With ``at`` the warmup's end and ``start`` the peak this is the plain schedule, written
        as transformers writes it (so a floor of 0 gives its values bit for bit)."""
        if self.kind == "constant":
            return start
        floor = self.floor_lr
        if self.kind == "polynomial":
            if step >= total:
                return floor
            remaining = 1 - (step - at) / (total - at)
            shaped: float = remaining**self.power  # remaining is in (0, 1]: a real power
            return (start - floor) * shaped + floor
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

    def _restarts_at(self, step: int) -> float:
        """cosine_with_restarts after the warmup. Its state is the phase, in cycles done (the lr restarts
        at each whole number), not an lr: an extension fits the cycles left at ``at_step`` to the new
        length from the phase reached there, so the curve neither jumps nor loses a restart, and a run
        that had finished its cycles stays at the floor."""
        at, total, phase = self.warmup_steps, self.total_steps, 0.0
        for ext_at, ext_total in self.extensions:
            if step < ext_at:
                break
            phase = self._phase(ext_at, at, total, phase)
            at, total = ext_at, ext_total
        progress = float(step - at) / float(max(1, total - at))
        if progress >= 1.0 or phase >= self.cycles:
            return self.floor_lr
        phase += (float(self.cycles) - phase) * progress  # float(cycles) * progress exactly from phase 0
        floor = self.floor_lr
        return floor + (self.base_lr - floor) * max(0.0, 0.5 * (1.0 + math.cos(math.pi * (phase % 1.0))))

    def _phase(self, step: int, at: int, total: int, start: float) -> float:
        """The cycles done at ``step`` of a segment that starts at phase ``start`` at step ``at`` and
        completes every cycle at ``total``."""
        if start >= self.cycles:
            return start
        progress = min(1.0, float(step - at) / float(max(1, total - at)))
        return start + (float(self.cycles) - start) * progress

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
            "cycles": self.cycles,
            "power": self.power,
            "end_lr": self.end_lr,
            "timescale": self.timescale,
        }

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LRSchedule:
        """The schedule :meth:`to_dict` wrote; ``ValueError``/``TypeError``/``KeyError`` when it is malformed.
        A checkpoint written before a field existed gets the field's default."""
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
            cycles=int(values.get("cycles", 1)),
            power=float(values.get("power", 1.0)),
            end_lr=float(values.get("end_lr", 1e-7)),
            timescale=None if values.get("timescale") is None else int(values["timescale"]),
        )
