"""Per-unit, per-phase timings, from device events and host clocks.

Device events are resolved only once they have completed (``query``), so recording timings never adds a
host sync to the hot path. The overlap of a unit is T_bwd / (T_d2h + T_update): at overlap >= 1
moving and updating a unit's gradients hides entirely behind the backward of the units before it.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from slide_core.device import Device, Event

__all__ = ["HOST_TRACKS", "PHASES", "TRACKS", "ComputeTimer", "Timeline", "TraceSpan", "UnitTimes"]

PHASES = ("forward", "backward", "head", "eval", "h2d", "d2h", "update", "wait", "upload", "write_back")
"""``eval``: the compute of :meth:`Engine.evaluate` (forward and loss), kept apart from training's.
``upload`` and ``write_back``: a GPU-streamed unit's master and moments to its staging set and back
(streamed_pipeline.py), kept apart from the loads' ``h2d`` and the gradients' ``d2h`` so that their bytes
over their seconds give the rate the streamed copies reached in the step."""

TRACKS = {
    "forward": "GPU compute",
    "backward": "GPU compute",
    "head": "GPU compute",
    "eval": "GPU compute",
    "h2d": "h2d",
    "d2h": "d2h",
    "upload": "h2d",
    "write_back": "d2h",
}
"""Which timeline track a phase is drawn on; ``update`` goes to 'CPU update' (or 'GPU compute' when a
device-resident unit is updated on the compute stream)."""

HOST_TRACKS = {"update": "CPU update", "wait": "main thread waits"}
"""The host phases a trace draws, each on its own track: the host optimizer's updates, and the main thread's
waits for a unit's parameters (a forward or backward that cannot start yet). Why the waits: a step longer
than its busiest resource is a wait somewhere, and this track says which unit's load the step stood still
for, beside the update it waited on."""


@dataclass(frozen=True)
class TraceSpan:
    unit: str
    phase: str
    track: str
    start_ms: float
    duration_ms: float


@dataclass
class UnitTimes:
    """Milliseconds per phase, and the bytes the spans of a phase moved where the recorder knows them
    (the streamed copies': ``bytes["upload"]`` over ``ms["upload"]`` is their achieved rate)."""

    ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def overlap(self) -> float | None:
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
        self._pending: list[tuple[str, str, Event, Event, int]] = []
        self.units: dict[str, UnitTimes] = defaultdict(UnitTimes)
        self._trace_origin: tuple[Event, float] | None = None
        self.trace: list[TraceSpan] = []

    def begin_trace(self, origin: Event) -> None:
        """Start recording spans with timestamps, relative to ``origin`` (a timing event recorded on an
        idle device) and to the host clock now. Both clocks then share the same zero."""
        with self._lock:
            self._trace_origin = (origin, time.perf_counter())
            self.trace = []

    def end_trace(self) -> list[TraceSpan]:
        self.resolve(block=True)
        with self._lock:
            self._trace_origin = None
            spans, self.trace = self.trace, []
        return sorted(spans, key=lambda span: span.start_ms)

    def device_span(self, unit: str, phase: str, start: Event, end: Event, nbytes: int = 0) -> None:
        """Record the device work between ``start`` and ``end`` (timing events), which moved ``nbytes``
        (0: not a copy, or not counted); resolved later (:meth:`resolve`), never here."""
        if self.enabled:
            with self._lock:
                self._pending.append((unit, phase, start, end, nbytes))

    def host_span(self, unit: str, phase: str, ms: float) -> None:
        """Record ``ms`` of host work on ``unit`` that ended just now."""
        if self.enabled:
            with self._lock:
                self.units[unit].ms[phase] += ms
                track = HOST_TRACKS.get(phase)
                if self._trace_origin is not None and track is not None:
                    start_ms = (time.perf_counter() - self._trace_origin[1]) * 1e3 - ms
                    self.trace.append(TraceSpan(unit, phase, track, start_ms, ms))

    def resolve(self, *, block: bool = False) -> None:
        """Fold completed device spans into the totals; with ``block``, wait for all of them."""
        with self._lock:
            pending, self._pending = self._pending, []
        keep = []
        for unit, phase, start, end, nbytes in pending:
            if block:
                end.synchronize()  # note: CPU-GPU sync point (only when a caller asks for final numbers)
            if end.query():
                duration = start.elapsed_ms(end)
                with self._lock:
                    self.units[unit].ms[phase] += duration
                    if nbytes:
                        self.units[unit].bytes[phase] += nbytes
                    if self._trace_origin is not None:
                        track = TRACKS.get(phase, "GPU compute")
                        offset = self._trace_origin[0].elapsed_ms(start)
                        self.trace.append(TraceSpan(unit, phase, track, offset, duration))
            else:
                keep.append((unit, phase, start, end, nbytes))
        with self._lock:
            self._pending = keep + self._pending

    def take(self) -> dict[str, UnitTimes]:
        """Return and reset the totals collected so far."""
        self.resolve()
        with self._lock:
            units, self.units = self.units, defaultdict(UnitTimes)
        return dict(units)


class ComputeTimer:
    """Times work issued on the device's compute stream (a unit's forward, backward or device-side update)
    into a :class:`Timeline`, recording timing events only while timings are on."""

    def __init__(self, device: Device, timeline: Timeline) -> None:
        self.device = device
        self.timeline = timeline

    def start(self) -> Event | None:
        return self.device.record_event("compute", timing=True) if self.timeline.enabled else None

    def stop(self, unit: str, phase: str, start: Event | None) -> None:
        if start is not None:
            self.timeline.device_span(unit, phase, start, self.device.record_event("compute", timing=True))
