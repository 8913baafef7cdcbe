"""GPU-streamed units: the master and the optimizer state live in host RAM, as for a host-updated unit,
but the update runs on the device. The unit's master and moments travel to the device for its backward,
its final gradient is applied there right after the backward produced it, and master and moments go
back to host RAM. The gradient never crosses PCIe and the host optimizer does no work for the unit.

Why: the host's AdamW moves about 26 bytes of host memory per parameter per step and runs at the host's
memory bandwidth, while the GPU waits (Note [The host-memory wall] in docs/design/engine.md). Streaming
moves 12 to 16 bytes per parameter each way over PCIe instead (fp32 master and moments; less with a split
master or compact moments) and puts the arithmetic where there is plenty of it.

- main thread, ``begin_step`` and ``contribute``: queue on the h2d thread the upload of the master shard
  and state of the first streamed unit in backward order into a staging set (update_staging.py), and at
  each streamed unit's gradient the upload of the next one, so that it arrives while the backward
  computes it; an upload waits for the unit's previous update (Note [Update futures]) and for the
  write-back that last read its set (with several contributions a step, Note [Streamed accumulation]);
- main thread, ``contribute``: the gradient is written in the slot, summed over the ranks into the shard
  (one reduce-scatter on the compute stream; nothing in one process), its squared norm folded on the
  device; the compute stream waits for the upload, a split master is decoded (``Optimizer.split_codec``),
  the device optimizer (``Optimizer.device_replica``) steps the staged shard, a split master is encoded
  back, and the d2h stream writes master
  and state back into the host slabs; a d2h-thread job resolves the unit's 'updated' future once they
  have landed, which is what the unit's next load waits for (Note [Update futures]);
- h2d thread, ``load``: as a host-updated unit (host_pipeline.py).

Note [Streamed updates are the host's arithmetic]: the staged master is an fp32 range that keeps the
host slab's positions (``Fp32Master.origin``), so compact moments are rounded with the same hash stream
whichever placement updates them, and a split master is decoded and encoded exactly: a unit's masters and
moments after a step are those of the host placement, bit for bit on the CPU device with the optimizer a
run builds (numba on the host, torch's fused AdamW in the device replica: the same fp32 arithmetic,
tests/core/test_streamed_pipeline.py and test_compact_state.py). On a GPU, torch's CUDA kernel may fuse a
multiply and an add into one rounding: a few ulp of the master after a step (tests/core/test_streamed_gpu.py).

Note [The backward reads the staged master]: a block is loaded twice a step, for its forward and for its
backward, and a streamed unit's update needs its master on the device right after the backward. So its
master and state are staged when the backward load is queued (:meth:`StreamedPipeline.before_load`), and
the load casts the staged master into the slot on the device: the unit's master crosses PCIe once for the
backward and the update together (fp32: 4 of the 20 bytes per parameter of a load, a master and fp32
moments). A staging set is taken only if one stays for every unit updated before it that has none yet,
since a set is given back only by its unit's update; otherwise the load reads the host, and the unit is
staged when the update before it is queued. A unit loaded once (kept in its slot from the forward) is
staged that way too.

Note [When a streamed unit is updated on the host]: a deferred clipped step holds its host units'
gradients until the step's norm is known (Note [Deferred clipped steps] in docs/design/engine.md), which a
device update right after the backward cannot do. Such a step sends a streamed unit's gradient to the
host optimizer instead, exactly as a host-updated unit does (this class is a :class:`HostPipeline`): the
same result, at the host's speed. Every other step updates on the device: a speculative clipped step
(Note [Streamed speculation]) and a step with several contributions to the unit (Note [Streamed
accumulation]). ``ctx.device_updated`` names the streamed units updated on the device whose final
gradient's norm stays there (:meth:`StreamedPipeline.updates_on_device`).

Note [Streamed accumulation]: with several gradient contributions to a unit in a step (gradient
accumulation over micro-batches, a tied embedding's head share and its own), every contribution but the
last goes the host's way: d2h, and summed by the optimizer thread into the unit's fp32 host accumulator
(``HostPipeline.apply``). The unit's upload then copies that sum into the fp32 ``sums`` its staging set
borrows beside master and moments (a pool of one buffer per summing unit in flight, allocated at the first
step that sums: Note [One sum per summing unit in flight] in sums_pool.py), the last contribution is added
to it on the device right after its backward, and the device updates the shard with the total. No buffer
is as large as the model: the sum lives in host RAM between micro-batches (the host placement's
accumulator, page-locked once) and on the device only as long as the master beside it.
Exactness: the device adds the last contribution to the host's sum as the host's ``accum.add_`` would
(fp32 plus a compute-dtype value, one rounding), so the final gradient is the host placement's bit for
bit; without clipping its norm is folded on the device as a resident unit's is. A step that speculates
needs the host placement's ``c_u`` and global norm, which sum a summed gradient's square on the host range
by range in fp64 (``ClipStrategy._add_square``). So the device forms its ``c_u`` from that square formed
the same way (``UnitNorms.summed_square``: each transfer chunk's fp32 norm squared in fp64, added in
order), applies ``c_u * g`` from a scratch (zeros for a non-finite square when the step skips such steps,
the summed gradient itself left whole), and the d2h stream writes the summed gradient back into the host
accumulator with the master; a d2h job queues, once it has landed, an optimizer job that hands it to the
clip strategy range by range as a host unit's last chunks are handed (``ClipStrategy.ranges``, whose
ranges were applied already): the square, the non-finite mark and the norm the step decides on are the
host placement's, and the unit counts as summed on the host (``StepContext.summed_on_host``). That d2h job
is the step's last transfer (``GradTransfer.last``), so the step's end waits for it before its barrier.
A correction then reads the kept gradient in the host accumulator, zeroed where the device applied zeros,
with the ``c_u`` the host recorded: the host's code on the host's numbers (Note [Streamed speculation]).
On a GPU the device's square may differ from the host's in the last bits, and so a correction's ``c_u``
from the one the device applied, by an ulp.

The schedule, and why it cannot deadlock. A staging set is given back only by its unit's update, and an
upload of a summed unit waits for the host to have summed the contributions before its last (a future
:meth:`apply` resolves with the last chunk of the one before the last). So a summed unit's upload is
queued only once that contribution has been sent (:meth:`_ready`): at a load of the unit in its last
micro-batch (``before_load``: a unit with one micro-batch left is loaded for that forward and backward,
and the load reads the host, since which visit it serves is not known there), at the update of the unit
before it in backward order (``_stage_after``), or at its own update. From then on the upload waits only
for work already issued: the previous step's update of the unit, the d2h copy of a gradient whose compute
was issued, the optimizer thread's sums of chunks the d2h thread hands over, none of which waits for the
h2d thread, so the h2d thread is never blocked on anything that waits for it. Had an upload been queued
in an earlier micro-batch (at the step's start, as a unit with one contribution is), the h2d thread would
wait for a sum whose backward needs loads queued behind that upload, and the step would hang. Sets are
handed out as with one contribution (:meth:`_can_stage`: one stays for every unit updated earlier that
has none), and every update of the step comes in the last micro-batch's backward, in backward order, so
the unit updated next always finds its set or a free one.

Note [Streamed speculation]: with clipping on, a step that speculates (Note [Speculative non-finite
guard] and "Clipping" in docs/design/engine.md) updates a streamed unit on the device as a resident unit
is updated: its squared norm and ``c_u`` are formed on the device (``ClipStrategy.device_coefficient``,
no host sync), a non-finite gradient is zeroed first, and the staged shard is stepped with ``c_u * g``
in ranges of the transfer chunk (an fp32 scratch of one chunk, ``ScaledGrads``). The gradient must
outlive the slot for a correction, so the d2h stream copies it, ahead of the write-back, into the unit's
range of the clipping store (``GradStore``, which prices every sliding unit: Note [Grad store reuse] in
grad_ring.py), with the shard's squared norm beside it (``UnitNorms.send``); the step's decision then
treats the unit as it treats a host unit:

- keep: a d2h-thread job resolves the unit's 'updated' future once the write-back has landed, as
  without clipping;
- rescale or undo: an optimizer-thread job waits for the write-back (and so the kept gradient) to land,
  then corrects the written-back master and state with ``HostPipeline.correct``, the host units' own
  code, on the host optimizer's chunks of the shard (``gradient_chunks``), told the coefficient the
  device applied (``ClipStrategy.applied_coefficient`` of the landed square: ``c_u`` is formed in fp64
  on both sides and rounded to fp32, so it is the same float), and resolves the future.

Why the host corrects rather than the device: the correction needs the master and moments, which have
already left the device; a second upload and write-back would cost 24 bytes per parameter over PCIe
where the host pass reads what it just received. Since the speculative update is the host's arithmetic
(Note [Streamed updates are the host's arithmetic]) and the correction is the host's code on the same
gradient and coefficient, masters and moments after a clipped step are the host placement's bit for bit.
A non-finite step is the exception: the host placement never applies a unit whose gradient is not
finite, nor any after it, while the device applies the zeroed gradient and the undo takes it back
arithmetically, so the result is exact to rounding only. Ordering is Note [Clip rollback ordering]'s:
the unit's next upload and load wait for its 'updated' future, hence for the correction, and its next
write into the store follows its next backward. What it costs: the gradient's d2h (compute-dtype bytes
per parameter, which the planner adds to the streamed unit's d2h) every speculative step, and a host
pass over the unit's master and state only in a step that clips; the step after a clipped one defers.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from slide_core.device import Device, Event
from slide_core.host_params import HostParameters
from slide_core.master_store import Fp32Master
from slide_core.optim.state_formats import StateArray, slice_state
from slide_core.optimizer import Correction, Optimizer
from slide_core.unit import Unit

from .clipping import AppliedRange, ScaledGrads
from .context import ClipStrategy, Contribution, ContributionKind, StepContext
from .grad_transfer import GradChunk, GradTransfer, gradient_chunks
from .host_pipeline import HostPipeline
from .host_span import pinned_spans
from .host_state import HostState
from .norms import UnitNorms
from .pipeline import write_gradients
from .replacement import StreamedPlacement
from .shards import UnitShards
from .slots import ParamSlot
from .state_store import HostSlabs
from .timeline import ComputeTimer
from .update_staging import STAGING_SETS, StagingSet, UpdateStaging
from .workers import Workers

__all__ = ["StreamedPipeline"]


class StreamedPipeline(HostPipeline):
    """The units updated on the device as they stream (``shards`` names them), their master and state in
    the host slabs. ``device_optimizer`` runs on the main thread (the resident pipeline's replica)."""

    def __init__(
        self,
        device: Device,
        host_params: HostParameters,
        host_state: HostState,
        optimizer: Optimizer,
        device_optimizer: Optimizer,
        transfer: GradTransfer,
        workers: Workers,
        norms: UnitNorms | None,
        timer: ComputeTimer,
        forward_position: Mapping[str, int],
        chunk_numel: int,
        *,
        shards: UnitShards,
        staging_sets: int = STAGING_SETS,
        placement: StreamedPlacement | None = None,
    ) -> None:
        super().__init__(
            device, host_params, host_state, optimizer, transfer, workers, norms, timer.timeline, forward_position,
            chunk_numel, shards=shards, store=HostSlabs(host_state),
        )  # fmt: skip
        self.device_optimizer = device_optimizer
        self.placement = placement or StreamedPlacement(shards.spans, shards.spans)
        """Which of its units are updated on the device now; the others take the host's path (Note
        [Re-placement at a step boundary] in replacement.py). None: every one."""
        self.codec = optimizer.split_codec
        """Decodes a staged split master right before its update and encodes it right after, on the
        compute stream (``Optimizer.split_codec``): one launch each with slide_kernels', thousands with
        torch's."""
        self.timer = timer
        self.arrays = optimizer.state_arrays
        max_numel = max((hi - lo for lo, hi in shards.spans.values()), default=0)
        self.staging = UpdateStaging(device, max_numel, self.arrays, split=host_params.split, sets=staging_sets)
        self.backward_order = sorted(shards.spans, key=lambda name: -forward_position[name])
        """The streamed units in the order their final gradients arrive (the reverse of the forward)."""
        self._staged: dict[str, tuple[StagingSet, Future[Event]]] = {}
        self._loads: dict[str, int] = {}  # loads queued per unit this step: the second is the backward's
        self._load_from: dict[str, StagingSet] = {}  # backward loads to serve from the staged master
        self._contributed: set[str] = set()
        self._ctx: StepContext | None = None
        self._write_backs: list[Future[None]] = []
        self._previous: Mapping[str, Future[None]] = {}  # the previous step's 'updated' futures
        self._current: Mapping[str, Future[None]] = {}
        self._pinned: list[torch.Tensor] = []
        self._scaled = ScaledGrads()  # main thread: ``c_u * g`` of one chunk (Note [Streamed speculation])
        self._speculated: dict[str, _Speculated] = {}  # this step's speculative device updates, to decide
        self._sent: dict[str, int] = {}  # contributions made so far this step, per unit updated on the device
        self._summing: dict[str, tuple[int, Future[None]]] = {}  # (the one before the last, host sum done)
        self._units: dict[str, Unit] = {}
        self._pinned_sums: dict[str, torch.Tensor] = {}  # host accumulators the uploads read (h2d thread)

    @staticmethod
    def device_bytes(
        max_shard_numel: int,
        state_arrays: Sequence[StateArray],
        *,
        split: bool,
        sets: int = STAGING_SETS,
        clipping_chunk: int | None = None,
        summing_numels: Collection[int] = (),
    ) -> int:
        """Device bytes this pipeline allocates: its staging sets and the pool of fp32 sums for the units
        that get several contributions a step, of shards of ``summing_numels`` elements
        (:meth:`UpdateStaging.bytes_for`; Note [One sum per summing unit in flight] in sums_pool.py), and
        with clipping (``clipping_chunk``: the transfer chunk) the fp32 ``c_u * g`` of one chunk (Note
        [Streamed speculation])."""
        staging = UpdateStaging.bytes_for(
            max_shard_numel, state_arrays, split=split, sets=sets, summing_numels=summing_numels
        )
        return staging + (4 * min(max_shard_numel, clipping_chunk) if clipping_chunk else 0)

    @staticmethod
    def optimizer_range_numel(max_shard_numel: int, chunk_numel: int, *, clipping: bool) -> int:
        """The longest range this pipeline hands the device optimizer: a decay range of a shard, or with
        clipping one transfer chunk (Note [Streamed speculation]). What ``Optimizer.device_scratch_bytes``
        is asked for."""
        return min(max_shard_numel, chunk_numel) if clipping else max_shard_numel

    def pin_host_ranges(self, others: Iterable[tuple[int, int]]) -> list[torch.Tensor]:
        """Page-lock what the streamed units move besides the plane their loads read (pinned with the
        host-updated masters): a split master's other planes and every state slab, over this rank's
        shards of the streamed units joined across ``others`` (this rank's shards of every other unit,
        in master elements), one span per stretch: one span in one process (Note [One registration per
        allocation] in host_span.py). The pages of a resident unit inside a span stay locked (its master's
        low planes are kept by the resident pipeline; its state range holds zeros until a drain), as for
        the master. Returns the master's spans."""
        host_params = self.host_params
        extents = [
            (host_params.offset(name) + lo, host_params.offset(name) + hi)
            for name, (lo, hi) in self.shards.spans.items()
        ]
        h2d_plane = host_params.store.h2d_plane
        master_spans: list[torch.Tensor] = []
        for start, end in pinned_spans(extents, others):
            for plane in host_params.planes.values():
                if plane.data_ptr() != h2d_plane.data_ptr():
                    ties = plane.dtype == torch.uint8  # one bit per element
                    master_spans.append(plane[start // 8 : -(-end // 8)] if ties else plane[start:end])
            for array in self.arrays:
                self._pinned.append(self.host_state.state_slabs[array.name][array.range(start, end)])
        self._pinned += master_spans
        for span in self._pinned:
            self.device.pin_host_range(span)
        return master_spans

    def unpin_host_ranges(self) -> None:
        """Give back what :meth:`pin_host_ranges` pinned, so that dropping the host state (before an
        export) frees its memory rather than leaving it registered until the device closes."""
        for span in (*self._pinned, *self._pinned_sums.values()):
            self.device.unpin_host_range(span)
        self._pinned = []
        self._pinned_sums = {}

    # -- which steps update on the device ----------------------------------------------------------------
    @staticmethod
    def updates_on_device(clip: ClipStrategy, contributions: int) -> bool:
        """Whether a unit with ``contributions`` gradient contributions in a step with ``clip`` is updated
        on the device with its final gradient's norm there (what ``StepContext.device_updated`` names):
        in every step but a deferred one (Note [When a streamed unit is updated on the host]), except that
        a speculating step sums a summed gradient's norm on the host (Note [Streamed accumulation])."""
        return not clip.deferred and (contributions == 1 or not clip.speculates)

    def _on_device(self, ctx: StepContext, name: str) -> bool:
        """Whether ``name``'s update of this step runs on the device (its norm may still be summed on the
        host: :meth:`updates_on_device`)."""
        return name in self.placement and not ctx.clip.deferred

    def begin_step(self, ctx: StepContext) -> None:
        super().begin_step(ctx)
        self._previous, self._current = self._current, ctx.updated
        self.staging.reset()
        self._staged.clear()
        self._loads.clear()
        self._load_from.clear()
        self._contributed.clear()
        self._ctx = ctx
        self._speculated.clear()
        self._sent.clear()
        self._summing.clear()
        self._write_backs = [future for future in self._write_backs if not future.done()]
        # The summed gradients' pool, allocated at the first step that sums (Note [One sum per summing unit
        # in flight]), for every unit this pipeline may update on the device, moved there or not: a move
        # allocates nothing.
        summing = [hi - lo for name, (lo, hi) in self.shards.spans.items() if ctx.expected[name] > 1]
        self.staging.hold_sums(summing)
        self._stage_after(None, ctx)

    # -- the upload, queued by the main thread, run by the h2d thread ------------------------------------
    def before_load(self, unit: Unit) -> None:
        """Main thread: a streamed unit's second load of a step is its backward's. When its update runs on
        the device, its master and state are staged first, and the load casts the staged master into
        the slot instead of reading the host again (Note [The backward reads the staged master])."""
        name, ctx = unit.name, self._ctx
        seen = self._loads.get(name, 0)
        self._loads[name] = seen + 1
        if ctx is None or name in self._contributed or not self._on_device(ctx, name):
            return  # updated already: a load after the step's update is an evaluation's, from the host
        if ctx.expected[name] > 1:  # staged at a load of its last micro-batch, which reads the host
            if self._ready(name, ctx) and self._can_stage(name, ctx):  # (Note [Streamed accumulation])
                self._stage(name)
            return
        if seen == 0 or not self._can_stage(name, ctx):
            return
        self._stage(name)
        self._load_from[name] = self._staged[name][0]

    def finish(self, unit: Unit, ctx: StepContext, correction: Correction) -> None:
        """The step's loads are all queued by now: a later load (an evaluation's, between steps) reads the
        host after the unit's latest update rather than staging it against the previous one. A unit
        updated on the device speculatively is released once its write-back has landed, or corrected on
        the host first (Note [Streamed speculation]); a unit updated on the host is the host's."""
        self._ctx = None
        speculated = self._speculated.pop(unit.name, None)
        if speculated is None:
            super().finish(unit, ctx, correction)
        elif correction.kind == "keep":
            self._write_backs.append(
                self.workers["d2h"].submit(_resolve_when_done, speculated.written, ctx.updated[unit.name])
            )
        else:
            job = self.workers["optimizer"].submit(
                self._correct_streamed, unit, speculated, correction, ctx, priority=(ctx.step, 1)
            )
            self._write_backs.append(job)

    def _correct_streamed(self, unit: Unit, speculated: _Speculated, correction: Correction, ctx: StepContext) -> None:
        """Optimizer thread: once the write-back and the kept gradient have landed, correct the device's
        speculative update of the unit on the host (Notes [Streamed speculation] and [Streamed
        accumulation]); resolves its future."""
        speculated.written.synchronize()  # note: CPU-GPU sync point (optimizer thread: the host reads what landed)
        lo, hi = self.shards[unit.name]
        decay_numel = unit.layout.decay_numel
        if speculated.norm_sq is None:  # a summed gradient, kept in the host accumulator
            accum = self.host_state.accumulator(unit, hi - lo)
            if speculated.zeroed:
                accum.zero_()  # what the device applied
            applied = speculated.applied

            def kept(start: int, end: int) -> torch.Tensor:
                return accum[start - lo : end - lo]
        else:
            store = self.transfer.store
            assert store is not None, "speculation runs with clipping on, which keeps the gradient store"
            applied = ctx.clip.applied_coefficient(float(speculated.norm_sq))

            def kept(start: int, end: int) -> torch.Tensor:
                return store.range(unit, start, end)

        ranges = [
            AppliedRange(start, end, kept(start, end), end <= decay_numel, applied)
            for start, end in gradient_chunks(hi, self.chunk_numel, decay_numel, start=lo)
        ]
        self.correct(unit, ranges, correction, ctx)

    def _can_stage(self, name: str, ctx: StepContext) -> bool:
        """Whether ``name`` may take a staging set now and still leave one for every unit whose update
        comes before it and that has none yet (they release theirs only by being updated)."""
        if name in self._staged:
            return True
        position = self.backward_order.index(name)
        waiting = sum(
            1
            for earlier in self.backward_order[:position]
            if earlier not in self._contributed and earlier not in self._staged and self._on_device(ctx, earlier)
        )
        return self.staging.free() > waiting

    def _ready(self, name: str, ctx: StepContext) -> bool:
        """Whether ``name``'s upload may be queued now: every contribution but its last has been sent to the
        host sum its upload waits for (Note [Streamed accumulation])."""
        return self._sent.get(name, 0) >= ctx.expected[name] - 1

    def _stage_after(self, name: str | None, ctx: StepContext) -> None:
        """Queue the upload of the streamed unit updated on the device after ``name`` in backward order
        (None: the first), if it may be queued yet."""
        order = self.backward_order
        for later in order[order.index(name) + 1 :] if name is not None else order:
            if self._on_device(ctx, later):
                if self._ready(later, ctx) and self._can_stage(later, ctx):
                    self._stage(later)
                return

    def _stage(self, name: str) -> None:
        if name in self._staged:
            return
        previous = self._previous.get(name)
        summing = self._summing.get(name)
        lo, hi = self.shards[name]
        staged = self.staging.take(None if summing is None else hi - lo)
        summed = None if summing is None else (summing[1], _sum_free_after(staged))
        uploaded = self.workers["h2d"].submit(self._upload, name, staged, previous, staged.free_after, summed)
        self._staged[name] = (staged, uploaded)

    def _upload(
        self,
        name: str,
        staged: StagingSet,
        previous: Future[None] | None,
        free_after: Event | None,
        summed: tuple[Future[None], Event | None] | None,
    ) -> Event:
        """h2d thread: once the unit's previous update is done, its master shard (fp32, or a split
        master's planes as they are) and state into ``staged``, after the write-back that last read it,
        and, ``summed``, once the host has summed them, its earlier contributions into the set's ``sums``
        after the write-back that last read that buffer (Note [One sum per summing unit in flight]);
        returns the event the backward's load and the update wait for."""
        if previous is not None:
            self.workers.wait(previous, f"the update of {name} before streaming it")
        device, host_params = self.device, self.host_params
        lo, hi = self.shards[name]
        n = hi - lo
        timing = self.timeline.enabled
        with device.stream("h2d"):
            if free_after is not None:
                device.wait_event("h2d", free_after)
            start = device.record_event("h2d", timing=True) if timing else None  # after the wait: copies only
            if host_params.split:
                copies = list(zip(self._planes(name, staged), self._host_planes(name), strict=True))
            else:
                copies = [(self._staged_master(staged)[:n], host_params.flat(name)[lo:hi])]
            copies += [(staged.state[array][: host.numel()], host) for array, host in self._host_state_of(name).items()]
            for target, source in copies:
                device.copy_to_device(target, source)
            if start is not None:  # master and moments: the upload's rate (the sum below waits on the host)
                nbytes = sum(source.numel() * source.element_size() for _, source in copies)
                self.timeline.device_span(name, "upload", start, device.record_event("h2d", timing=True), nbytes)
            if summed is not None:
                host_summed, sums_free_after = summed
                self.workers.wait(host_summed, f"the host's sum of {name}'s earlier gradients")
                if sums_free_after is not None:
                    device.wait_event("h2d", sums_free_after)
                device.copy_to_device(self._sums(staged)[:n], self._host_sum(name, n))
            return device.record_event("h2d")

    def _host_sum(self, name: str, numel: int) -> torch.Tensor:
        """h2d thread: the unit's host accumulator (its shard's fp32 sum), page-locked the first time, as
        every other host range a streamed unit moves is (:meth:`pin_host_ranges`)."""
        accum = self.host_state.accumulator(self._units[name], numel)
        if name not in self._pinned_sums:
            self.device.pin_host_range(accum)
            self._pinned_sums[name] = accum
        return accum

    def load(self, unit: Unit, slot: ParamSlot, ready: Future[None], reuse_after: Event | None) -> Event:
        """h2d thread: a backward load :meth:`before_load` staged reads the staged master (its upload ran
        just before on this thread and stream); any other load reads the host (host_pipeline.py)."""
        staged = self._load_from.pop(unit.name, None)
        if staged is None:
            return super().load(unit, slot, ready, reuse_after)
        self.workers.wait(ready, f"the update of {unit.name} before loading it")
        device = self.device
        lo, hi = self.shards[unit.name]
        target = slot.params[: unit.layout.numel]
        source = staged.planes["hi"] if self.host_params.split else self._staged_master(staged)
        with device.stream("h2d"):
            if reuse_after is not None:
                device.wait_event("h2d", reuse_after)
            start = device.record_event("h2d", timing=self.timeline.enabled)
            target[lo:hi].copy_(source[: hi - lo])  # the host load's cast, on the device (Note [Casting uploads])
            self.collectives.all_gather_(target, f"the all-gather of {unit.name}'s parameters")
            end = device.record_event("h2d", timing=self.timeline.enabled)
        self.timeline.device_span(unit.name, "h2d", start, end)
        return end

    def _host_state_of(self, name: str) -> dict[str, torch.Tensor]:
        lo, hi = self.shards[name]
        return self.host_state.range(self.host_state.views(name), lo, hi)

    # -- the update, main thread (compute stream) --------------------------------------------------------
    def contribute(
        self,
        unit: Unit,
        slot: ParamSlot,
        grads: Mapping[str, torch.Tensor | None],
        contribution: Contribution,
        ctx: StepContext,
    ) -> None:
        name = unit.name
        if not self._on_device(ctx, name):
            super().contribute(unit, slot, grads, contribution, ctx)
            return
        self._units[name] = unit
        if not contribution.final:
            self._sum_on_host(unit, slot, grads, contribution, ctx)
            return
        self._sent[name] = contribution.index + 1
        # queued with a load of the step's last micro-batch, at the update before it, or here
        self._stage(name)
        self._wait_grads_free(unit, slot)
        write_gradients(unit, slot.grads, grads, add=False)
        start = self.timer.start()
        final = slot.grads[: unit.layout.numel]
        self.collectives.reduce_scatter_(final, f"the reduce-scatter of {name}'s gradient")
        lo, hi = self.shards[name]
        staged, uploaded = self._staged.pop(name)
        if contribution.kind is ContributionKind.ONLY:
            written = self._update(unit, slot, final[lo:hi], staged, uploaded, ctx)
        else:
            written = self._update_summed(unit, slot, final[lo:hi], staged, uploaded, ctx)
        self.staging.release(staged, written)
        self._contributed.add(name)
        self.timer.stop(name, "update", start)
        self._stage_after(name, ctx)  # the next one arrives while the backward computes it

    def _sum_on_host(
        self,
        unit: Unit,
        slot: ParamSlot,
        grads: Mapping[str, torch.Tensor | None],
        contribution: Contribution,
        ctx: StepContext,
    ) -> None:
        """A contribution before the last of a unit updated on the device: summed on the host as the host
        placement sums it. Once the one before the last is sent, the unit's upload may be queued (Note
        [Streamed accumulation])."""
        name = unit.name
        if contribution.index == ctx.expected[name] - 2:  # resolved by :meth:`apply` once it is summed
            summed: Future[None] = Future()
            lo, hi = self.shards[name]
            if lo == hi:  # an empty shard sends no chunk: nothing to wait for
                summed.set_result(None)
            self._summing[name] = (contribution.index, summed)
        super().contribute(unit, slot, grads, contribution, ctx)
        self._sent[name] = contribution.index + 1

    def apply(self, chunk: GradChunk, grad: torch.Tensor) -> None:
        """Optimizer thread: a landed chunk, as the host's; the last chunk of a summed unit's contribution
        before its last one tells the unit's upload that the sum it copies is complete."""
        super().apply(chunk, grad)
        summing = self._summing.get(chunk.unit.name)
        if chunk.last_chunk and summing is not None and summing[0] == chunk.contribution.index:
            summing[1].set_result(None)

    def _wait_upload(self, name: str, uploaded: Future[Event]) -> None:
        event = self.workers.wait(uploaded, f"the upload of {name}'s master and state")
        self.device.wait_event("compute", event)

    def _update(
        self,
        unit: Unit,
        slot: ParamSlot,
        shard: torch.Tensor,
        staged: StagingSet,
        uploaded: Future[Event],
        ctx: StepContext,
    ) -> Event:
        """Main thread: the update of a unit with one contribution, its gradient ``shard`` in the slot;
        returns the end of its write-back."""
        name = unit.name
        coeff = ctx.clip.device_coefficient(self.norms, unit, shard)  # None: final as applied
        if coeff is None and self.norms is not None:
            self.norms.add(unit, shard, first=True)
        kept = None if coeff is None else self._keep_gradient(unit, shard)
        self._wait_upload(name, uploaded)
        self._step_on_device(unit, staged, shard, ctx, coeff)
        written = self._write_back(name, staged, self.device.record_event("compute"))
        if kept is None:
            slot.grads_free = None  # read by the compute stream only: stream order frees it
            self._resolve_after(written, name, ctx)
        else:
            slot.grads_free = kept.freed
            self._speculated[name] = _Speculated(written, kept.norm_sq)
        return written

    def _resolve_after(self, written: Event, name: str, ctx: StepContext) -> None:
        """An update that stands as applied: a d2h-thread job resolves the unit's 'updated' future once its
        write-back ``written`` has landed (Note [Update futures])."""
        self._write_backs.append(self.workers["d2h"].submit(_resolve_when_done, written, ctx.updated[name]))

    def _update_summed(
        self,
        unit: Unit,
        slot: ParamSlot,
        shard: torch.Tensor,
        staged: StagingSet,
        uploaded: Future[Event],
        ctx: StepContext,
    ) -> Event:
        """Main thread: the last contribution ``shard`` added to the host's sum of the earlier ones, staged
        beside the master, and the update of that final gradient (Note [Streamed accumulation]); returns
        the end of its write-back."""
        name, device, norms = unit.name, self.device, self.norms
        self._wait_upload(name, uploaded)
        final = self._sums(staged)[: shard.numel()]
        final.add_(shard)  # the host's ``accum.add_`` of the last chunk, on the device
        slot.grads_free = None  # read by the compute stream only
        clip = ctx.clip
        if not clip.speculates:
            if norms is not None:  # the final gradient's norm, as a resident unit's (it is in device_updated)
                norms.add(unit, final, first=True)
            self._step_on_device(unit, staged, final, ctx, None)
            written = self._write_back(name, staged, device.record_event("compute"))
            self._resolve_after(written, name, ctx)
            return written
        lo, hi = self.shards[name]
        chunks = gradient_chunks(hi, self.chunk_numel, unit.layout.decay_numel, start=lo)
        squared = UnitNorms.summed_square(final, [(start - lo, end - lo) for start, end in chunks])
        coeff = clip.summed_coefficient(norms, unit, squared)
        assert coeff is not None, "a speculating step has a device coefficient"
        nonfinite = ~torch.isfinite(squared) if clip.skip_nonfinite else None
        self._step_on_device(unit, staged, final, ctx, coeff, zeroed=nonfinite)
        accum = self.host_state.accumulator(unit, hi - lo)  # the host sum the upload read: the kept gradient
        written = self._write_back(name, staged, device.record_event("compute"), kept=(accum, final))
        speculated = self._speculated[name] = _Speculated(written, None)
        self.transfer.last = self.workers["d2h"].submit(self._land_sum, unit, speculated, ctx)  # the step's end waits
        return written

    def _land_sum(self, unit: Unit, speculated: _Speculated, ctx: StepContext) -> Event:
        """d2h thread: once the summed gradient has landed in the host accumulator, queue the host's account
        of it (:meth:`_account_sum`) ahead of the step's decision, as a host unit's last chunk is."""
        speculated.written.synchronize()  # note: CPU-GPU sync point (d2h thread, by design)
        position = self.forward_position[unit.name]
        priority = (ctx.step, 0, position, ctx.expected[unit.name] - 1)
        self.workers["optimizer"].submit(self._account_sum, unit, speculated, ctx, priority=priority)
        return speculated.written

    def _account_sum(self, unit: Unit, speculated: _Speculated, ctx: StepContext) -> None:
        """Optimizer thread: the step's clip strategy takes the unit's summed gradient range by range, as
        it takes a host unit's (``ClipStrategy.ranges``): its squared norm, summed as the host placement
        sums it, and a non-finite mark. The ranges it hands back were applied on the device already; what
        the device applied is recorded for the correction (Note [Streamed accumulation])."""
        clip, name = ctx.clip, unit.name
        lo, hi = self.shards[name]
        accum = self.host_state.accumulator(unit, hi - lo)
        chunks = list(gradient_chunks(hi, self.chunk_numel, unit.layout.decay_numel, start=lo))
        for number, (start, end) in enumerate(chunks):
            clip.ranges(
                unit, start, end, accum[start - lo : end - lo], summed=True, last_chunk=number == len(chunks) - 1
            )
        assert clip.host_sq is not None, "a speculating step sums squares on the host"
        squared = clip.host_sq.get(name, 0.0)
        speculated.applied = clip.applied_coefficient(squared)
        speculated.zeroed = clip.skip_nonfinite and not math.isfinite(squared)

    def _keep_gradient(self, unit: Unit, shard: torch.Tensor) -> _Kept:
        """Main thread: the d2h stream copies the shard's squared norm and (non-finite zeroed) gradient
        into pinned host memory, for a correction (Note [Streamed speculation]); the slot's gradient
        buffer is free once they are copied."""
        store, norms, device = self.transfer.store, self.norms, self.device
        assert store is not None and norms is not None, "speculation runs with clipping on"
        lo, hi = self.shards[unit.name]
        computed = device.record_event("compute")
        with device.stream("d2h"):
            device.wait_event("d2h", computed)
            norm_sq = norms.send(unit)
            store.range(unit, lo, hi).copy_(shard, non_blocking=True)
            copied = device.record_event("d2h")
        freed: Future[Event] = Future()
        freed.set_result(copied)
        return _Kept(freed, norm_sq)

    @staticmethod
    def _sums(staged: StagingSet) -> torch.Tensor:
        assert staged.sums is not None, "a summing unit's set borrows a summed-gradient buffer (_stage)"
        return staged.sums.values

    @staticmethod
    def _staged_master(staged: StagingSet) -> torch.Tensor:
        assert staged.master is not None, "an fp32 master is staged as it is"
        return staged.master

    def _fp32_values(self, name: str, staged: StagingSet) -> torch.Tensor:
        """Compute stream: the staged shard's fp32 master; a split master decoded into the one buffer
        every set's update shares (Note [Three staging sets]), encoded back by :meth:`_write_back`."""
        lo, hi = self.shards[name]
        if not self.host_params.split:
            return self._staged_master(staged)[: hi - lo]
        assert self.staging.values is not None
        values, first_bit = self.staging.values[: hi - lo], self.host_params.offset(name) + lo
        hi_plane, lo_plane, ties = self._planes(name, staged)
        self.codec.decode(hi_plane, lo_plane, ties, first_bit % 8, values)
        return values

    def _tie_bytes(self, name: str) -> tuple[int, int]:
        """The host tie bytes ``[first, end)`` that hold ``name``'s shard's bits."""
        lo, hi = self.shards[name]
        base = self.host_params.offset(name)
        return (base + lo) // 8, -(-(base + hi) // 8)

    def _planes(self, name: str, staged: StagingSet) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The staged split planes of ``name``'s shard: hi, lo, and the tie bytes from the one holding its
        first bit (what :meth:`_host_planes` names on the host, element for element)."""
        lo, hi = self.shards[name]
        first_byte, end_byte = self._tie_bytes(name)
        planes = staged.planes
        return planes["hi"][: hi - lo], planes["lo"][: hi - lo], planes["ties"][: end_byte - first_byte]

    def _host_planes(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The host split planes of ``name``'s shard: hi, lo and its tie bytes."""
        lo, hi = self.shards[name]
        base = self.host_params.offset(name)
        first_byte, end_byte = self._tie_bytes(name)
        planes = self.host_params.planes
        return (
            planes["hi"][base + lo : base + hi],
            planes["lo"][base + lo : base + hi],
            planes["ties"][first_byte:end_byte],
        )

    def _step_on_device(
        self,
        unit: Unit,
        staged: StagingSet,
        grad: torch.Tensor,
        ctx: StepContext,
        coeff: torch.Tensor | None,
        *,
        zeroed: torch.Tensor | None = None,
    ) -> None:
        """The update of the staged shard with its gradient ``grad`` (the shard's, from its first element)
        on positions of the host slab (Note [Streamed updates are the host's arithmetic]): one optimizer
        call per decay range, or with a speculative ``coeff`` (on the device) one per transfer chunk of
        ``coeff * grad`` (Note [Streamed speculation]), zeros where ``zeroed`` (a 0-dim device bool) is
        set, ``grad`` itself left as it is (Note [Streamed accumulation])."""
        lo, hi = self.shards[unit.name]
        master_view = self._fp32_values(unit.name, staged)
        master = Fp32Master(master_view, self.host_params.offset(unit) + lo - int(master_view.storage_offset()))
        decay_numel, numel = unit.layout.decay_numel, unit.layout.numel
        if coeff is None:
            ranges = self.shards.cut(unit.name, ((0, decay_numel, True), (decay_numel, numel, False)))
        else:
            chunks = gradient_chunks(hi, self.chunk_numel, decay_numel, start=lo)
            ranges = [(start, end, end <= decay_numel) for start, end in chunks]
        for start, end, decay in ranges:
            state = slice_state(self.arrays, staged.state, start - lo, end - lo)
            applied = grad[start - lo : end - lo] if coeff is None else self._scaled(grad[start - lo : end - lo], coeff)
            if zeroed is not None:
                applied.masked_fill_(zeroed, 0.0)  # the scratch of ``coeff * grad``, never ``grad``
            self.device_optimizer.step(
                master[start - lo : end - lo], applied, state, lr=ctx.lr, step=ctx.step, decay=decay
            )

    def _write_back(
        self, name: str, staged: StagingSet, updated: Event, *, kept: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> Event:
        """Main thread: a split master encoded on the compute stream, then master and state copied back to
        the host slabs on the d2h stream, and ``kept`` (host target, device gradient) with them; returns
        the copies' end."""
        device, host_params = self.device, self.host_params
        lo, hi = self.shards[name]
        n, base = hi - lo, host_params.offset(name)
        if host_params.split:
            assert self.staging.values is not None
            staged_planes = self._planes(name, staged)
            self.codec.encode(self.staging.values[:n], *staged_planes, (base + lo) % 8)
            updated = device.record_event("compute")
            copies = list(zip(self._host_planes(name), staged_planes, strict=True))
        else:
            copies = [(host_params.flat(name)[lo:hi], self._staged_master(staged)[:n])]
        copies += [(host, staged.state[array][: host.numel()]) for array, host in self._host_state_of(name).items()]
        copies += [kept] if kept is not None else []
        timing = self.timeline.enabled
        with device.stream("d2h"):
            device.wait_event("d2h", updated)
            start = device.record_event("d2h", timing=True) if timing else None  # after the wait: copies only
            for target, source in copies:
                target.copy_(source, non_blocking=True)
            written = device.record_event("d2h", timing=timing)
        if start is not None:
            nbytes = sum(source.numel() * source.element_size() for _, source in copies)
            self.timeline.device_span(name, "write_back", start, written, nbytes)
        return written

    def flush(self) -> None:
        for future in self._write_backs:
            self.workers.wait(future, "the write-back of a streamed unit's master and state")
        self._write_backs = []
        super().flush()


@dataclass(frozen=True)
class _Kept:
    """A speculatively updated unit's gradient on its way to the host: ``freed`` (resolved) holds the d2h
    event after which the slot's buffer may be written again; ``norm_sq`` is the pinned squared norm."""

    freed: Future[Event]
    norm_sq: torch.Tensor


@dataclass
class _Speculated:
    """A unit updated on the device in a speculative step, waiting for the step's decision: ``written``,
    the d2h event after which its master, state and kept gradient are in host memory; ``norm_sq``, the
    pinned squared norm of its shard the update's ``c_u`` was formed from, or None for a summed gradient,
    whose ``c_u`` (``applied``) and zeroing (``zeroed``) the optimizer thread records (Note [Streamed
    accumulation])."""

    written: Event
    norm_sq: torch.Tensor | None
    applied: float = 1.0
    zeroed: bool = False


def _sum_free_after(staged: StagingSet) -> Event | None:
    """Main thread, as the set is taken: when the summed-gradient buffer it borrowed may be written."""
    assert staged.sums is not None, "a summing unit's set borrows a summed-gradient buffer"
    return staged.sums.free_after


def _resolve_when_done(landed: Event, updated: Future[None]) -> None:
    """d2h thread: once the write-back has landed in host RAM, the unit's next load may read it."""
    landed.synchronize()
    updated.set_result(None)
