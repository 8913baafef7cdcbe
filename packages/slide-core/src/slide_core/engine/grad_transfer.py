"""The device-to-host stage of host-updated units: a unit's gradient buffer streamed in chunks into pinned
host memory (the ring, or with clipping the grad store: grad_ring.py), each landed chunk queued for the
optimizer thread. Shared by every host-side pipeline; runs on the ``d2h`` thread.

Note [Only landed chunks are queued]: the d2h thread waits for each chunk's copy to land before it queues
the chunk for the optimizer. The optimizer thread takes the queued chunk of the lowest next-forward
position (Note [Optimizer priority] in workers.py); had it been handed chunks still in flight, it would
pick the newest one, which the GPU reaches last, and sit in that chunk's event while landed chunks of
earlier units waited. With the pinned clipping store (no ring to throttle the d2h thread) that left the CPU
idle for the whole backward: every host update ran after it. A ring chunk is handed over before the next
one is taken, so a ring of one chunk cannot deadlock. Tested by
``test_a_ring_of_one_chunk_neither_deadlocks_nor_changes_the_math``.

Note [The ring is sized for the host's units]: the ring holds the backlog the host optimizer carries
(``EngineConfig.grad_ring_fraction`` of what it updates). A GPU-streamed unit sends a gradient here only
in a step that sums several contributions to it, and then only those before its last, which the optimizer
thread adds into its accumulator without updating anything (Note [Streamed accumulation] in
streamed_pipeline.py; with clipping on, every gradient goes to the store, which keeps pricing every unit),
so they add no backlog and the ring is sized for the host-updated units alone: a ring smaller than a
backlog only makes the backward wait for free chunks. With most of a 14B model streamed that is some 11 GiB of pinned RAM less (0.5 x 2 bytes per
streamed parameter). Tested by ``test_streamed_units_leave_the_ring_to_the_host_units``.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from slide_core.allocation_ledger import AllocationLedger
from slide_core.device import Device, Event
from slide_core.unit import Unit

from .config import EngineConfig
from .context import Contribution, StepContext
from .grad_ring import GradRing, GradStore
from .norms import UnitNorms
from .timeline import Timeline
from .workers import Workers

__all__ = ["ChunkSink", "GradChunk", "GradTransfer", "gradient_chunks"]


@dataclass(frozen=True)
class GradChunk:
    """One landed range ``[start, end)`` of one gradient contribution of a unit."""

    unit: Unit
    start: int
    end: int
    contribution: Contribution
    last_chunk: bool
    ctx: StepContext
    norm_sq: torch.Tensor | None = None
    """On the first chunk of a unit's final contribution (when the step checks norms): the pinned squared
    norm of the unit's gradient, landed before this chunk; checked before anything is applied."""


class ChunkSink(Protocol):
    def apply(self, chunk: GradChunk, grad: torch.Tensor) -> None:
        """Optimizer thread: take one landed chunk (``grad`` is valid until this returns)."""


class GradTransfer:
    """Streams host-updated units' gradients to the optimizer thread through pinned host memory."""

    def __init__(
        self,
        device: Device,
        workers: Workers,
        host_units: Sequence[Unit],
        config: EngineConfig,
        timeline: Timeline,
        norms: UnitNorms | None,
        spans: Mapping[str, tuple[int, int]] | None = None,
        gpu_updated: Collection[str] = (),
        *,
        ledger: AllocationLedger | None = None,
    ) -> None:
        """``spans``: the range ``[lo, hi)`` of each unit's gradient to stream (a data-parallel rank's
        shard, see shards.py); the whole unit where absent. ``gpu_updated``: the units of ``host_units``
        that are GPU-streamed (Note [The ring is sized for the host's units]). ``ledger``: the engine's,
        which counts the ring or the store."""
        self.device = device
        self.workers = workers
        self.timeline = timeline
        self.norms = norms
        self.chunk_numel = config.transfer_chunk_numel
        self.ring: GradRing | None = None
        self.store: GradStore | None = None
        if config.clipping:  # see grad_ring.py: the store replaces the ring
            self.store = GradStore(device, host_units, config.compute_dtype, spans, ledger=ledger)
        else:
            # The backlog a ring holds is of what this process streams: with data parallel, its shards.
            every_step = [unit for unit in host_units if unit.name not in gpu_updated]
            streamed = [spans[unit.name] if spans else (0, unit.layout.numel) for unit in every_step]
            slots = config.ring_slots(sum(hi - lo for lo, hi in streamed))
            self.ring = GradRing(device, slots, config.transfer_chunk_numel, config.compute_dtype, ledger=ledger)

        self._consumed: dict[str, Future[None]] = {}  # d2h thread only, see Note [Grad store reuse]
        self.spans: Mapping[str, tuple[int, int]] = spans or {}
        self.last: Future[Event] | None = None
        """The step's last d2h job (what the end of a clipped step waits for)."""

    @staticmethod
    def host_bytes(config: EngineConfig, streamed_numels: Sequence[int], gpu_updated_numels: Sequence[int] = ()) -> int:
        """Pinned host bytes of the gradients in flight, for host-updated units of which this process
        streams ``streamed_numels`` elements each and GPU-streamed units of ``gpu_updated_numels``: the
        store of every one with clipping on, else the ring (:meth:`EngineConfig.ring_slots` chunks) for
        the host-updated ones (Note [The ring is sized for the host's units]). The planner prices
        ``grad_ring`` from this."""
        dtype_bytes = config.compute_dtype.itemsize
        if config.clipping:
            return GradStore.slab_bytes([*streamed_numels, *gpu_updated_numels], dtype_bytes)
        slots = config.ring_slots(sum(streamed_numels))
        return GradRing.slab_bytes(slots, config.transfer_chunk_numel, dtype_bytes)

    def begin_step(self) -> None:
        self.last = None

    def send(
        self,
        sink: ChunkSink,
        unit: Unit,
        grads: torch.Tensor,
        computed: Event,
        contribution: Contribution,
        ctx: StepContext,
        order: tuple[int, ...],
    ) -> Future[Event]:
        """Main thread: stream ``grads`` once ``computed`` has happened; each landed chunk goes to
        ``sink.apply`` on the optimizer thread, by ``order`` (Note [Optimizer priority]). Returns the
        job, whose event says when the buffer may be written again."""
        self.last = self.workers["d2h"].submit(self._d2h_job, sink, unit, grads, computed, contribution, ctx, order)
        return self.last

    def _d2h_job(
        self,
        sink: ChunkSink,
        unit: Unit,
        grads: torch.Tensor,
        computed: Event,
        contribution: Contribution,
        ctx: StepContext,
        order: tuple[int, ...],
    ) -> Event:
        """d2h thread: stream the unit's gradient in chunks; each landed chunk becomes an optimizer job.

        Chunks go to ring slots, or with clipping on straight to the unit's range of the grad store. On a
        unit's final contribution its squared norm goes first, so it has landed when the first chunk has.
        """
        device, workers, ring, store = self.device, self.workers, self.ring, self.store
        span_start, span_end = self.spans.get(unit.name, (0, unit.layout.numel))
        chunks = list(gradient_chunks(span_end, self.chunk_numel, unit.layout.decay_numel, start=span_start))
        start = None
        end = computed
        norm_sq: torch.Tensor | None = None
        with device.stream("d2h"):
            device.wait_event("d2h", computed)
            if ctx.clip.checks_norms and contribution.final:
                assert self.norms is not None
                norm_sq = self.norms.send(unit)
            if store is not None:
                previous = self._consumed.get(unit.name)  # see Note [Grad store reuse] in grad_ring.py
                if previous is not None:
                    workers.wait(previous, f"the optimizer to take the previous gradient of {unit.name}")
            consumed: Future[None] | None = None
            landing: list[_InFlight] = []
            for number, (lo, hi) in enumerate(chunks):
                index: int | None = None
                if store is not None:
                    target = store.range(unit, lo, hi)
                else:
                    assert ring is not None
                    consumed = self._hand_over_landed(sink, landing) or consumed  # they free ring chunks
                    index = workers.get(ring.free, "a free gradient ring chunk")
                    target = ring.chunks[index][: hi - lo]
                if start is None:
                    start = device.record_event("d2h", timing=self.timeline.enabled)
                target.copy_(grads[lo:hi], non_blocking=True)
                end = device.record_event("d2h", timing=self.timeline.enabled)
                last = number == len(chunks) - 1
                first_norm = norm_sq if number == 0 else None
                chunk = GradChunk(unit, lo, hi, contribution, last, ctx, first_norm)
                landing.append(_InFlight(chunk, target, index, end, (*order, lo)))
            consumed = self._hand_over_landed(sink, landing) or consumed
            if store is not None and consumed is not None:
                self._consumed[unit.name] = consumed
        if start is not None:
            self.timeline.device_span(unit.name, "d2h", start, end)
        return end

    def _hand_over_landed(self, sink: ChunkSink, landing: list[_InFlight]) -> Future[None] | None:
        """d2h thread: wait for each chunk's copy to land, then queue it for the optimizer; return the last
        job's future. See Note [Only landed chunks are queued]."""
        consumed = None
        for job in landing:
            job.landed.synchronize()  # note: CPU-GPU sync point (on the d2h thread, by design)
            consumed = self.workers["optimizer"].submit(
                self._update_job, sink, job.chunk, job.target, job.index, job.landed, priority=job.priority
            )
        landing.clear()
        return consumed

    def _update_job(
        self, sink: ChunkSink, chunk: GradChunk, grad: torch.Tensor, index: int | None, landed: Event
    ) -> None:
        """Optimizer thread: apply one landed chunk, then give its ring slot (if any) back."""
        landed.synchronize()  # note: CPU-GPU sync point (on the optimizer thread, by design)
        try:
            sink.apply(chunk, grad)
        finally:
            if index is not None and self.ring is not None:
                self.ring.release(index)


@dataclass(frozen=True)
class _InFlight:
    """A gradient chunk whose device-to-host copy is issued but not yet known to have landed."""

    chunk: GradChunk
    target: torch.Tensor
    index: int | None
    landed: Event
    priority: tuple[int, ...]


def gradient_chunks(numel: int, chunk: int, decay_numel: int, *, start: int = 0) -> Iterator[tuple[int, int]]:
    """Split ``[start, numel)`` into ring-sized chunks that never straddle the decay boundary: the ranges
    a host unit's gradient is applied in, and a GPU-streamed unit's speculative update and correction."""
    cuts = sorted({start, numel, *((decay_numel,) if start < decay_numel < numel else ())})
    for lo, hi in itertools.pairwise(cuts):
        for offset in range(lo, hi, chunk):
            yield offset, min(hi, offset + chunk)
