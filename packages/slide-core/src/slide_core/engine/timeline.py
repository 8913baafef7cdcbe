"""Per-unit, per-phase timings, from device events and host clocks.

Device events are resolved only once they have completed (``query``), so recording timings never adds a
host sync to the hot path. The hiding factor of a unit is eta = T_bwd / (T_d2h + T_update): at eta >= 1
moving and updating a unit's gradients hides entirely behind the backward of the units before it.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

from slide_core.device import Event

__all__ = ["PHASES", "Timeline", "UnitTimes"]

PHASES = ("forward", "backward", "head", "h2d", "d2h", "update", "wait")


@dataclass
class UnitTimes:
    ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def eta(self) -> float | None:
        denominator = self.ms["d2h"] + self.ms["update"]
        busy = self.ms["backward"] + self.ms["head"]
        if denominator <= 0.0 or busy <= 0.0:
            return None
        return busy / denominator


class Timeline:
    """Collects timings from the main, transfer and optimizer threads."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._pending: list[tuple[str, str, Event, Event]] = []
        self.units: dict[str, UnitTimes] = defaultdict(UnitTimes)

    def device_span(self, unit: str, phase: str, start: Event, end: Event) -> None:
        if self.enabled:
            with self._lock:
                self._pending.append((unit, phase, start, end))

    def host_span(self, unit: str, phase: str, ms: float) -> None:
        if self.enabled:
            with self._lock:
                self.units[unit].ms[phase] += ms

    def resolve(self, *, block: bool = False) -> None:
        """Fold completed device spans into the totals; with ``block``, wait for all of them."""
        with self._lock:
            pending, self._pending = self._pending, []
        keep = []
        for unit, phase, start, end in pending:
            if block:
                end.synchronize()  # note: CPU-GPU sync point (only when a caller asks for final numbers)
            if end.query():
                with self._lock:
                    self.units[unit].ms[phase] += start.elapsed_ms(end)
            else:
                keep.append((unit, phase, start, end))
        with self._lock:
            self._pending = keep + self._pending

    def take(self) -> dict[str, UnitTimes]:
        """Return and reset the totals collected so far."""
        self.resolve()
        with self._lock:
            units, self.units = self.units, defaultdict(UnitTimes)
        return dict(units)
