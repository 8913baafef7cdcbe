"""The step as a schedule: every unit's loads, compute, gradient transfer and update, in the order the engine
runs them, on the servers that run them; the steady-state step time that order gives.

Why a schedule and not only the busiest resource (slide_hf/planner/unit_costs.py): the resources of a step do
not overlap freely. A unit's next-step load waits for its update; the host optimizer cannot start before
the first gradient lands and works off its backlog while the next forward loads, which reads host memory
beside it. Measured on an H100 host (16 cores, 128 GiB), llama3.1-8b at batch 16 x 1024, ``--gpu-memory
24``, every block host-updated from an fp32 master: a 2.17 s step whose busiest resource (GPU compute) took
1.53 s; the resource maximum predicted 1.54 s. Likewise a unit's backward needs its slot, which frees only
when the gradient in it has left, and a streamed unit's staging upload needs a free staging set, which frees
only when an earlier unit's master and moments are back on the host (Note [Three staging sets] in
slide_core/engine/update_staging.py).

The model: four servers, each doing one thing at a time in the engine's order: the GPU's compute stream
(forward, backward, the head, GPU updates), the host-to-device copies (weight loads and streamed units'
staging), the device-to-host copies (gradients and streamed units' write-backs) and the host optimizer. An operation starts when its server is free and what it needs has
finished:

- a forward load: the unit's update of the previous step, and a free slot (``block_slots`` slots for blocks,
  the earliest freed first; the embedding and head have their own); it runs at ``H2D_BESIDE_HOST`` of the
  link's rate while the host optimizer works;
- a forward or backward: the unit's load (or staging upload), and the compute stream;
- a host-updated unit's gradient d2h: its backward; its host update: the gradient, and the optimizer, which
  works on the landed gradient the next forward needs first (Note [Optimizer priority] in
  slide_core/engine/workers.py), so what is left when the backward ends is the last blocks, updated while
  the next forward runs;
- a streamed unit's staging upload: a free staging set (the write-back of the streamed unit ``staging_sets``
  earlier in the backward); its GPU update follows its backward on the compute stream, its write-back that.
  A summed one (several gradient contributions a step, Note [Streamed accumulation] in
  slide_core/engine/streamed_pipeline.py) is a host-updated unit in every micro-batch but the last (its
  gradient out, the host's sum); in the last its backward loads the host master and its staging brings the
  sum with master and moments.

The last ``block_slots`` blocks of the forward are still in their slots when the backward begins and load
no more. While the backward both loads and sends gradients, the link carries the two directions at the
rate they reach together (``duplex_gbps``), shared in proportion to each direction's rate alone.

What is left out: the gradient ring's room (sized to hold the host's backlog, ``grad_ring_fraction``),
host memory bandwidth and NVMe (the resource maximum still bounds the step: the plan's
step time is the larger of the two), gradient accumulation's extra micro-batches (the schedule's step is the
micro-batches' forward and backward run back to back, the updates after the last), and per-step host work
(loss, clipping's norm), measured at tens of milliseconds.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ScheduleRates", "UnitWork", "simulate_step"]

_STEPS = 4
"""Steps simulated from a cold start; the last one's duration is the steady state's (the cold start's
effect is gone after two: each step's waits depend only on the previous one's)."""


H2D_BESIDE_HOST = 0.56
"""The share of its rate alone a weight load reaches while the host optimizer works: both read host memory,
and the optimizer's fused pass alone nearly fills it. Measured on an H100 host (16 cores, 128 GiB),
llama3.1-8b, fp32 master, host placement: the forward's loads at 31 GB/s against 55 GB/s alone while the
optimizer worked off the backward's backlog."""


@dataclass(frozen=True)
class UnitWork:
    """One unit's work in a step (seconds, bytes), in forward order in :func:`simulate_step`'s ``units``.

    ``placement``: ``host`` (gradient out, host update), ``streamed`` (master and moments in for the
    backward, GPU update, back out; with ``summed``, several gradient contributions a step: the earlier
    ones out and summed on the host as a host unit's, ``accumulate_s`` each) or ``resident`` (GPU update;
    no transfers). ``forward_s`` and
    ``backward_s``: GPU compute per micro-batch (the head's forward and backward both in ``forward_s``).
    ``load_bytes``: one weight load; ``loads_in_backward``: whether the backward loads it again (False for
    the embedding, whose backward reads no weights, and the head, computed at once). ``stage_bytes``,
    ``writeback_bytes``: a streamed unit's master and moments each way. ``grad_bytes``: a host-updated unit's
    gradient per micro-batch. ``update_s``: the update on its server (the host optimizer, or the GPU for
    streamed and resident units); ``accumulate_s``: a host-updated unit's host work for each earlier
    micro-batch's gradient (summing it)."""

    name: str
    placement: str
    numel: int
    forward_s: float
    backward_s: float
    load_bytes: float
    grad_bytes: float
    update_s: float
    stage_bytes: float = 0.0
    writeback_bytes: float = 0.0
    accumulate_s: float = 0.0
    is_block: bool = True
    loads_in_backward: bool = True
    summed: bool = False

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"{self.name}: placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")


PLACEMENTS = ("host", "streamed", "resident")


@dataclass(frozen=True)
class ScheduleRates:
    """Link rates in bytes per second and the engine's buffers that order the work."""

    h2d: float
    d2h: float
    duplex: float
    block_slots: int
    staging_sets: int
    micro_batches: int = 1

    def __post_init__(self) -> None:
        if (
            min(self.h2d, self.d2h, self.duplex) <= 0
            or min(self.block_slots, self.staging_sets, self.micro_batches) < 1
        ):
            raise ValueError(f"schedule rates must be positive, got {self}")

    @property
    def both_ways_share(self) -> float:
        """Each direction's share of its rate alone while both copy at once: the two together reach
        ``duplex``, and never less than the faster direction alone (a default duplex rate, derived from
        the slower direction, would otherwise throttle a fast one beside a slow one)."""
        if math.isinf(max(self.duplex, self.h2d, self.d2h)):  # a free link (or direction) slows nothing
            return 1.0
        return min(1.0, max(self.duplex, self.h2d, self.d2h) / (self.h2d + self.d2h))


_NO_WAIT = -math.inf
"""A ready time that waits for nothing."""

_TOLERANCE = 1e-12
"""Relative floating-point noise: margins and increments within it of each other are equal."""

_EXACT_LIMIT = 256
"""Micro-batches a step simulates one by one, at most, while looking for one that repeats
(Note [Micro-batches in steady state]); past it, the rest are extrapolated from the last one's increments."""


_LONGEST_CYCLE = 4
"""The longest cycle of micro-batches looked for: a schedule may alternate between two ways of running one
(a slot freed early every other micro-batch), each repeating every second one."""


class _Tape:
    """The margins of the comparisons one micro-batch makes, in the order it makes them, each with the
    magnitude of its operands (Note [Micro-batches in steady state]). A comparison with an infinite operand
    (a ready time that waits for nothing) decides nothing that could change, and is left out."""

    def __init__(self) -> None:
        self.margins: list[float] = []
        self.magnitudes: list[float] = []

    def _record(self, a: float, b: float) -> None:
        if math.isfinite(a) and math.isfinite(b):
            self.margins.append(a - b)
            self.magnitudes.append(max(abs(a), abs(b)))

    def max(self, a: float, b: float) -> float:
        self._record(a, b)
        return max(a, b)

    def min(self, a: float, b: float) -> float:
        self._record(a, b)
        return min(a, b)

    def le(self, a: float, b: float) -> bool:
        self._record(b, a)
        return a <= b


class _Servers:
    """When each server is next free (seconds from the current micro-batch's start)."""

    def __init__(self) -> None:
        self.compute = 0.0
        self.h2d = 0.0
        self.d2h = 0.0
        self.host = 0.0

    def run(self, server: str, ready: float, seconds: float, tape: _Tape) -> float:
        """Start ``seconds`` of work on ``server`` once it is free and ``ready`` has passed; its end."""
        end = tape.max(getattr(self, server), ready) + seconds
        setattr(self, server, end)
        return end

    def copy_in(
        self, ready: float, size: float, rate: float, slow_until: float, slow_rate: float, tape: _Tape
    ) -> float:
        """An h2d copy of ``size`` bytes once ``ready``: at ``slow_rate`` while the host optimizer works
        (until ``slow_until``), at ``rate`` after; its end."""
        start = tape.max(self.h2d, ready)
        slow_s = tape.min(tape.max(0.0, slow_until - start), size / slow_rate)
        end = start + slow_s + (size - slow_s * slow_rate) / rate
        self.h2d = end
        return end


class _SlotPool:
    """``count`` slots, each handed out again once freed: the earliest freed first."""

    def __init__(self, count: int) -> None:
        self.free = [0.0] * count

    def take(self, tape: _Tape) -> float:
        """A slot: when it is free (which slot is the earliest is a comparison with every other)."""
        earliest = heapq.heappop(self.free)
        for other in self.free:
            tape.max(other, earliest)
        return earliest

    def give(self, free_at: float) -> None:
        heapq.heappush(self.free, free_at)


def _host_updates(jobs: list[tuple[int, float, float]], free_at: float, tape: _Tape | None = None) -> dict[int, float]:
    """When each of ``jobs`` (forward position, gradient landed at, host seconds) is done on the host
    optimizer, free from ``free_at``: at every moment it works on the landed job the next forward needs
    first (the lowest position), switching as soon as a more urgent gradient lands (it takes one chunk at a
    time: Note [Optimizer priority] in slide_core/engine/workers.py)."""
    tape = tape or _Tape()
    pending = sorted(jobs, key=lambda job: job[1])
    for earlier, later in itertools.pairwise(pending):
        tape.max(later[1], earlier[1])
    left = {position: seconds for position, _, seconds in jobs}
    done: dict[int, float] = {}
    landed: list[int] = []  # positions, a heap
    now, arrival = free_at, 0
    while len(done) < len(jobs):
        while arrival < len(pending) and tape.le(pending[arrival][1], now):
            heapq.heappush(landed, pending[arrival][0])
            arrival += 1
        if not landed:
            now = tape.max(now, pending[arrival][1])
            continue
        position = landed[0]
        next_landing = pending[arrival][1] if arrival < len(pending) else math.inf
        run = tape.min(left[position], next_landing - now)
        now += run
        left[position] -= run
        if tape.le(left[position], 1e-12):
            heapq.heappop(landed)
            done[position] = now
    return done


def simulate_step(units: Sequence[UnitWork], rates: ScheduleRates, *, deferred: bool = False) -> float:
    """Seconds of one steady-state step of ``units`` (forward order) at ``rates``.

    ``deferred``: every step is a deferred clipped one (Note [Deferred steps]): no host update starts
    before the step's backward has ended.

    Its cost does not grow with ``rates.micro_batches``: the micro-batches before a step's last are
    simulated one by one only until one repeats the one before it, and the rest follow from that one's
    increments (Note [Micro-batches in steady state])."""
    schedule = _Schedule(units, rates, deferred=deferred)
    seconds = 0.0
    for _ in range(_STEPS):
        seconds = schedule.step()
    return seconds


# Note [Deferred steps]
# ~~~~~~~~~~~~~~~~~~~~~
# A step that clipped makes the next one defer (Note [Deferred clipped steps] in
# slide_core/engine/clip_strategy.py): its host updates wait for the global norm, so they start when the
# backward has ended, not as each gradient lands, and the next forward's loads wait behind them. While
# clipping fires on every step, every step after the first is such a step, and the host optimizer's whole
# pass lies between the backward and the loads it gates: measured on an H100 host (16 cores, 126 GiB),
# llama3.1-8b at batch 16 x 1024, --gpu-memory 24, host updates, --max-grad-norm 1 firing on every step,
# 3.02-3.11 s steps against 2.23-2.48 s planned for steps that speculate. The caller prices the streamed
# units of such a step as host-updated ones (that step updates them on the host).

# Note [Micro-batches in steady state]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every time in a micro-batch is a free time of the state it starts from (the servers, the slots, the units'
# updates) plus durations, chosen by comparisons (max, min, which slot is free first, which gradient has
# landed). Between two boundaries where every comparison came out the same way, the next state is therefore
# the same affine function of the previous one; so where two consecutive micro-batches made the same
# decisions and moved every part of the state by the same increment, every later one moves it by that
# increment again, for as long as its decisions stay the same. A comparison's margin then changes by the
# same amount each micro-batch (its drift), so each decision holds until its margin crosses zero: the
# schedule jumps over the micro-batches before the first crossing, adding the increment times their count,
# and simulates on from there (where a decision changes, the state settles again within a few micro-batches).
# Each part of the state may have its own increment: a host optimizer slower than the GPU falls further
# behind every micro-batch, and the forward's loads, slowed while it works, are slowed for good once it does.
# Margins and increments are compared to within ``_TOLERANCE`` of their operands (floating-point noise), a
# drift within it counts as none. The state is kept relative to the compute stream's free time at each
# micro-batch boundary, so its numbers stay of the order of one micro-batch however many run. Past
# ``_EXACT_LIMIT`` micro-batches without a repeat (a cycle longer than one micro-batch, which no schedule in
# the tests shows), the rest are extrapolated from the last increments.


@dataclass(frozen=True)
class _MicroBatch:
    """What one simulated micro-batch left: its comparisons, the state after it, the compute stream's advance."""

    tape: _Tape
    state: list[float]
    period: float


class _Schedule:
    """The engine's order over steps, one step at a time: servers, slots and each unit's latest update,
    relative to the compute stream's free time at the last micro-batch boundary."""

    def __init__(self, units: Sequence[UnitWork], rates: ScheduleRates, *, deferred: bool = False) -> None:
        self.units = units
        self.rates = rates
        self.deferred = deferred  # Note [Deferred steps]
        self.servers = _Servers()
        self.blocks = _SlotPool(rates.block_slots)
        self.updated = {unit.name: _NO_WAIT for unit in units}  # when each unit's latest update is done
        self.share = rates.both_ways_share
        sliding_blocks = [u for u in units if u.placement != "resident" and u.is_block]
        self.kept = {u.name for u in sliding_blocks[-rates.block_slots :]}  # still in a slot at the turnaround

    def step(self) -> float:
        """Seconds of the next step: its micro-batches, the updates after the last."""
        seconds = 0.0
        recent: list[_MicroBatch] = []  # the last ones simulated, enough to compare two cycles of each length
        left = self.rates.micro_batches - 1  # before the last
        exact = 0
        while left > 0:
            tape, period = self._micro_batch(last=False)
            seconds += period
            left -= 1
            exact += 1
            recent = [*recent[-2 * _LONGEST_CYCLE :], _MicroBatch(tape, self._state(), period)]
            jump = self._jump(recent, left, extrapolate=exact >= _EXACT_LIMIT)
            if jump is not None:
                count, increments, jump_s = jump
                self._advance(increments, 1)
                seconds += jump_s
                left -= count
                recent = []
        return seconds + self._micro_batch(last=True)[1]

    def _state(self) -> list[float]:
        """The free times that carry from one micro-batch to the next (the compute stream's is 0)."""
        s = self.servers
        return [s.h2d, s.d2h, s.host, *sorted(self.blocks.free), *(self.updated[u.name] for u in self.units)]

    def _advance(self, increments: list[float], count: int) -> None:
        """Move the state on by ``count`` micro-batches of ``increments``."""
        state = [value + count * step for value, step in zip(self._state(), increments, strict=True)]
        self.servers.h2d, self.servers.d2h, self.servers.host = state[:3]
        slots = len(self.blocks.free)
        self.blocks.free = sorted(state[3 : 3 + slots])
        self.updated = {u.name: value for u, value in zip(self.units, state[3 + slots :], strict=True)}

    def _jump(
        self, recent: list[_MicroBatch], left: int, *, extrapolate: bool
    ) -> tuple[int, list[float], float] | None:
        """``(micro-batches, their increments, their seconds)`` that repeat the last cycle of micro-batches
        exactly, at most ``left``; None where none is known to (Note [Micro-batches in steady state]).
        ``extrapolate``: every one left, by the last micro-batch's increments, where none repeats."""
        for length in range(1, _LONGEST_CYCLE + 1):
            cycles = self._repeats(recent, left, length)
            if cycles:
                increments = _increments(recent[-1].state, recent[-1 - length].state)
                period = sum(m.period for m in recent[-length:])
                return cycles * length, [cycles * step for step in increments], cycles * period
        if extrapolate and len(recent) >= 2:
            increments = _increments(recent[-1].state, recent[-2].state)
            return left, [left * step for step in increments], left * recent[-1].period
        return None

    @staticmethod
    def _repeats(recent: list[_MicroBatch], left: int, length: int) -> int:
        """How many more cycles of ``length`` micro-batches repeat the last one exactly (0: none known to)."""
        if len(recent) < 2 * length + 1 or left < length:
            return 0
        before, previous, now = recent[-1 - 2 * length], recent[-1 - length], recent[-1]
        first, second = recent[-2 * length : -length], recent[-length:]
        period0, period1 = sum(m.period for m in first), sum(m.period for m in second)
        if not _close(period1, period0, period1):
            return 0
        steps = zip(
            now.state, _increments(previous.state, before.state), _increments(now.state, previous.state), strict=True
        )
        if not all(_close(one, two, max(abs(value), period1)) for value, one, two in steps):
            return 0
        margins0 = [x for m in first for x in m.tape.margins]
        margins1 = [x for m in second for x in m.tape.margins]
        magnitudes = [x for m in second for x in m.tape.magnitudes]
        if len(margins0) != len(margins1):
            return 0
        repeats = left // length
        for margin0, margin1, magnitude in zip(margins0, margins1, magnitudes, strict=True):
            tolerance = _TOLERANCE * max(magnitude, period1)
            if _sign(margin0, tolerance) != _sign(margin1, tolerance):
                return 0
            drift = margin1 - margin0
            if abs(drift) > tolerance and abs(margin1) > tolerance and (drift > 0) != (margin1 > 0):
                repeats = min(repeats, int(abs(margin1) / abs(drift)) - 1)  # before the margin reaches zero
        return max(0, repeats)

    def _micro_batch(self, *, last: bool) -> tuple[_Tape, float]:
        """One forward and backward over the units, with the updates after it when ``last``; its tape and
        how far the compute stream moved, by which every time is then moved back."""
        units, rates, servers, blocks, updated, kept = (
            self.units,
            self.rates,
            self.servers,
            self.blocks,
            self.updated,
            self.kept,
        )
        tape = _Tape()
        loaded: dict[str, float] = {}
        # -- forward: loads (after the unit's previous update) ahead of the compute, as slots free up --
        for unit in units:
            ready = _NO_WAIT
            if unit.placement != "resident":
                slot_free = blocks.take(tape) if unit.is_block else _NO_WAIT
                ready = servers.copy_in(
                    tape.max(updated[unit.name], slot_free),
                    unit.load_bytes,
                    rates.h2d,
                    servers.host,
                    rates.h2d * H2D_BESIDE_HOST,
                    tape,
                )
                loaded[unit.name] = ready
            end = servers.run("compute", ready, unit.forward_s, tape)
            if unit.placement != "resident" and unit.is_block and unit.name not in kept:
                blocks.give(end)
        # -- backward, in reverse: load or stage, compute, then the gradient out or the update on the GPU --
        h2d_rate, d2h_rate = rates.h2d * self.share, rates.d2h * self.share
        streamed_done: list[float] = []  # write-back ends of the streamed units so far, in backward order
        host_jobs: list[tuple[int, float, float]] = []  # (forward position, gradient landed, host seconds)
        for position, unit in reversed(list(enumerate(units))):
            ready = _NO_WAIT
            slot_free = _NO_WAIT
            on_gpu = unit.placement == "resident" or (unit.placement == "streamed" and (last or not unit.summed))
            if unit.placement == "streamed" and (last or not unit.summed):
                sets = rates.staging_sets
                set_free = streamed_done[-sets] if len(streamed_done) >= sets else _NO_WAIT
                if unit.is_block and unit.name not in kept:
                    slot_free = blocks.take(tape)
                if unit.summed and unit.loads_in_backward and unit.name not in kept:  # the load reads the host
                    slot_free = servers.run("h2d", slot_free, unit.load_bytes / h2d_rate, tape)
                ready = servers.run("h2d", tape.max(set_free, slot_free), unit.stage_bytes / h2d_rate, tape)
            elif unit.placement != "resident" and unit.loads_in_backward and unit.name not in kept:
                slot_free = blocks.take(tape) if unit.is_block else _NO_WAIT
                ready = servers.run("h2d", slot_free, unit.load_bytes / h2d_rate, tape)
            elif unit.name in loaded:
                ready = loaded[unit.name]
            computed = servers.run("compute", ready, unit.backward_s, tape)
            released = computed
            if on_gpu:
                if last:
                    gpu_updated = servers.run("compute", computed, unit.update_s, tape)
                    released = gpu_updated
                    if unit.placement == "streamed":
                        back = servers.run("d2h", gpu_updated, unit.writeback_bytes / d2h_rate, tape)
                        streamed_done.append(back)
                        updated[unit.name] = back
                    else:
                        updated[unit.name] = gpu_updated
            else:
                released = servers.run("d2h", computed, unit.grad_bytes / d2h_rate, tape)
                host_jobs.append((position, released, unit.update_s if last else unit.accumulate_s))
            if unit.placement != "resident" and unit.is_block:
                blocks.give(released)
        if last and self.deferred:  # the updates wait for the norm, known once the backward has ended
            backward_end = servers.compute
            host_jobs = [(position, tape.max(landed, backward_end), s) for position, landed, s in host_jobs]
        done = _host_updates(host_jobs, servers.host, tape)
        servers.host = functools.reduce(tape.max, done.values(), servers.host)  # done no earlier than it
        if last:
            for position, finished in done.items():
                updated[units[position].name] = finished
        period = servers.compute
        self._advance([-period] * len(self._state()), 1)
        servers.compute = 0.0
        return tape, period


def _increments(state: list[float], before: list[float]) -> list[float]:
    """``state - before``, an unchanged infinity (a unit not yet updated) moving by 0."""
    return [0.0 if now == then else now - then for now, then in zip(state, before, strict=True)]


def _close(a: float, b: float, magnitude: float) -> bool:
    return abs(a - b) <= _TOLERANCE * max(magnitude, abs(a), abs(b))


def _sign(margin: float, tolerance: float) -> int:
    return 0 if abs(margin) <= tolerance else 1 if margin > 0 else -1
