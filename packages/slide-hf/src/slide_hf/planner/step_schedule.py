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

import heapq
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
    backward, GPU update, back out; only a unit with one gradient contribution per step, which the engine
    updates on the GPU: pass ``host`` for one with several) or ``resident`` (GPU update; no transfers). ``forward_s`` and
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


class _Servers:
    """When each server is next free (seconds from the first step's start)."""

    def __init__(self) -> None:
        self.compute = 0.0
        self.h2d = 0.0
        self.d2h = 0.0
        self.host = 0.0

    def run(self, server: str, ready: float, seconds: float) -> float:
        """Start ``seconds`` of work on ``server`` once it is free and ``ready`` has passed; its end."""
        end = max(getattr(self, server), ready) + seconds
        setattr(self, server, end)
        return end

    def copy_in(self, ready: float, size: float, rate: float, slow_until: float, slow_rate: float) -> float:
        """An h2d copy of ``size`` bytes once ``ready``: at ``slow_rate`` while the host optimizer works
        (until ``slow_until``), at ``rate`` after; its end."""
        start = max(self.h2d, ready)
        slow_s = min(max(0.0, slow_until - start), size / slow_rate)
        end = start + slow_s + (size - slow_s * slow_rate) / rate
        self.h2d = end
        return end


class _SlotPool:
    """``count`` slots, each handed out again once freed: the earliest freed first."""

    def __init__(self, count: int) -> None:
        self._free = [0.0] * count

    def take(self) -> float:
        """A slot: when it is free."""
        return heapq.heappop(self._free)

    def give(self, free_at: float) -> None:
        heapq.heappush(self._free, free_at)


def _host_updates(jobs: list[tuple[int, float, float]], free_at: float) -> dict[int, float]:
    """When each of ``jobs`` (forward position, gradient landed at, host seconds) is done on the host
    optimizer, free from ``free_at``: at every moment it works on the landed job the next forward needs
    first (the lowest position), switching as soon as a more urgent gradient lands (it takes one chunk at a
    time: Note [Optimizer priority] in slide_core/engine/workers.py)."""
    pending = sorted(jobs, key=lambda job: job[1])
    left = {position: seconds for position, _, seconds in jobs}
    done: dict[int, float] = {}
    landed: list[int] = []  # positions, a heap
    now, arrival = free_at, 0
    while len(done) < len(jobs):
        while arrival < len(pending) and pending[arrival][1] <= now:
            heapq.heappush(landed, pending[arrival][0])
            arrival += 1
        if not landed:
            now = max(now, pending[arrival][1])
            continue
        position = landed[0]
        next_landing = pending[arrival][1] if arrival < len(pending) else float("inf")
        run = min(left[position], next_landing - now)
        now += run
        left[position] -= run
        if left[position] <= 1e-12:
            heapq.heappop(landed)
            done[position] = now
    return done


def simulate_step(units: Sequence[UnitWork], rates: ScheduleRates) -> float:
    """Seconds of one steady-state step of ``units`` (forward order) at ``rates``."""
    servers = _Servers()
    blocks = _SlotPool(rates.block_slots)
    updated = {unit.name: 0.0 for unit in units}  # when each unit's latest update is done (host RAM current)
    share = rates.both_ways_share
    ends = []
    for _ in range(_STEPS):
        for micro in range(rates.micro_batches):
            last = micro == rates.micro_batches - 1
            _micro_batch(units, rates, servers, blocks, updated, share, last=last)
        ends.append(servers.compute)
    return ends[-1] - ends[-2]


def _micro_batch(
    units: Sequence[UnitWork],
    rates: ScheduleRates,
    servers: _Servers,
    blocks: _SlotPool,
    updated: dict[str, float],
    share: float,
    *,
    last: bool,
) -> None:
    """One forward and backward over ``units``, with the updates after it when ``last``."""
    sliding_blocks = [u for u in units if u.placement != "resident" and u.is_block]
    kept = {u.name for u in sliding_blocks[-rates.block_slots :]}  # still in a slot at the turnaround
    loaded: dict[str, float] = {}
    # -- forward: loads (after the unit's previous update) ahead of the compute, as slots free up --
    for unit in units:
        ready = 0.0
        if unit.placement != "resident":
            slot_free = blocks.take() if unit.is_block else 0.0
            ready = servers.copy_in(
                max(updated[unit.name], slot_free),
                unit.load_bytes,
                rates.h2d,
                servers.host,
                rates.h2d * H2D_BESIDE_HOST,
            )
            loaded[unit.name] = ready
        end = servers.run("compute", ready, unit.forward_s)
        if unit.placement != "resident" and unit.is_block and unit.name not in kept:
            blocks.give(end)
    # -- backward, in reverse: load or stage, compute, then the gradient out or the update on the GPU --
    h2d_rate, d2h_rate = rates.h2d * share, rates.d2h * share
    streamed_done: list[float] = []  # write-back ends of the streamed units so far, in backward order
    host_jobs: list[tuple[int, float, float]] = []  # (forward position, gradient landed, host seconds)
    for position, unit in reversed(list(enumerate(units))):
        ready = 0.0
        slot_free = 0.0
        if unit.placement == "streamed":
            set_free = streamed_done[-rates.staging_sets] if len(streamed_done) >= rates.staging_sets else 0.0
            if unit.is_block and unit.name not in kept:
                slot_free = blocks.take()
            ready = servers.run("h2d", max(set_free, slot_free), unit.stage_bytes / h2d_rate)
        elif unit.placement != "resident" and unit.loads_in_backward and unit.name not in kept:
            slot_free = blocks.take() if unit.is_block else 0.0
            ready = servers.run("h2d", slot_free, unit.load_bytes / h2d_rate)
        elif unit.name in loaded:
            ready = loaded[unit.name]
        computed = servers.run("compute", ready, unit.backward_s)
        released = computed
        if unit.placement in ("resident", "streamed"):
            if last:
                gpu_updated = servers.run("compute", computed, unit.update_s)
                released = gpu_updated
                if unit.placement == "streamed":
                    back = servers.run("d2h", gpu_updated, unit.writeback_bytes / d2h_rate)
                    streamed_done.append(back)
                    updated[unit.name] = back
                else:
                    updated[unit.name] = gpu_updated
        else:
            released = servers.run("d2h", computed, unit.grad_bytes / d2h_rate)
            host_jobs.append((position, released, unit.update_s if last else unit.accumulate_s))
        if unit.placement != "resident" and unit.is_block:
            blocks.give(released)
    done = _host_updates(host_jobs, servers.host)
    servers.host = max(done.values(), default=servers.host)
    if last:
        for position, finished in done.items():
            updated[units[position].name] = finished
