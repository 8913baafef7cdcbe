"""Host-updated units: the fp32 master lives in host RAM, the optimizer state in a store (host RAM or a
tier, state_store.py), and each gradient crosses PCIe to the optimizer thread, which updates the master
while the device computes earlier units. The pipeline works on this rank's shard ``[lo, hi)`` of every
unit (shards.py): the whole unit in one process, 1/N of it on each of N data-parallel ranks.

- main thread (``contribute``): write the gradient into the slot's buffer, sum it over the ranks into the
  shard (a reduce-scatter, in place in the slot; nothing in one process), fold the shard's squared norm
  on the device, hand the shard to the d2h stage (grad_transfer.py streams ``[lo, hi)`` only);
- optimizer thread (``apply``): sum several contributions in an fp32 accumulator; each range of the final
  gradient goes to the step's clip strategy, which says with what coefficient to apply it now (or holds
  it); a clipped step's decision comes back through ``finish`` as one correction or held-update job per
  unit (Note [Clip rollback ordering] in docs/design/engine.md);
- h2d thread (``load``): wait for the unit's last update (Note [Update futures]), copy the shard of the
  master in and all-gather the slot, so every rank computes with the whole, updated unit.
- ``state_array`` / ``restore_target``: the shard of each unit, so a rank's checkpoint is its shards
  (Engine.checkpoint_arrays), which slide_core/checkpoint reads back at any world size.

The master is stored as ``HostParameters.master_format`` says: the optimizer steps
``HostParameters.master`` (an fp32 range or a split one) and the h2d copies ``h2d_source`` (the fp32 range,
cast on the device, or the split master's bf16 plane as it is: half the bytes over PCIe).

Note [Sharded stream order]: on a GPU with several ranks the reduce-scatter is ordered on the d2h stream
(after an event of the compute that wrote the gradient) and the all-gather on the h2d stream (after the
shard's copy), so the compute stream never waits for a collective; the shard's squared norm is formed on
the d2h stream after the reduce-scatter, and the d2h of the shard waits for that. The one wait of the
compute stream is at the end of the step, before the loss and the norms are read
(``UnitPipelines.sum_loss_and_norms``). In one process nothing is summed and all of it stays on the
compute stream (``Collectives.sum_gradient``). On the CPU device streams are no-ops and every collective
blocks the host thread that issues it.

Note [Sharded master]: a rank never reads its host master outside its shards before a drain: a load copies
``[lo, hi)`` up and the all-gather fills the rest, the update writes ``[lo, hi)``, a checkpoint reads
``[lo, hi)``, and a device-resident unit's compute copy is all-gathered once at the start
(resident_pipeline.py). So a master loaded with ``HostParameters.keep_shards`` (only the shards written), and
page-locked stretch by stretch of its shards (``UnitPipelines``, Note [One registration per allocation] in
host_span.py: never across another rank's shards), costs each rank 1/N of its bytes: the other pages are never
touched. The drain (:meth:`HostPipeline.sync_to_host`) gathers the whole master on every rank, for an export.
Tested by ``test_ranks_match_one_process_at_the_global_batch`` (every rank loads its shards only) and
``test_a_sharded_master_costs_its_shard`` (tests/core/test_sharded_master.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import cast

import torch

from slide_core.device import Device, Event
from slide_core.host_params import HostParameters
from slide_core.optimizer import Correction, Optimizer
from slide_core.unit import Unit

from .clipping import AppliedRange
from .context import Contribution, ContributionKind, StepContext
from .grad_transfer import GradChunk, GradTransfer
from .host_state import HostState
from .master_upload import MasterUpload
from .norms import UnitNorms
from .pipeline import write_gradients
from .shards import UnitShards
from .slots import ParamSlot
from .state_store import HostSlabs, ReadAhead, StateStore
from .timeline import Timeline
from .workers import Workers

__all__ = ["HostPipeline"]


class HostPipeline:
    """The units whose update runs on the host optimizer thread: their shards (``shards``, which names
    the units), their master in ``host_params``, their optimizer state in ``store`` (the host slabs of
    ``host_state`` by default)."""

    def __init__(
        self,
        device: Device,
        host_params: HostParameters,
        host_state: HostState,
        optimizer: Optimizer,
        transfer: GradTransfer,
        workers: Workers,
        norms: UnitNorms | None,
        timeline: Timeline,
        forward_position: Mapping[str, int],
        chunk_numel: int,
        *,
        shards: UnitShards,
        store: StateStore | None = None,
    ) -> None:
        self.device = device
        self.host_params = host_params
        self.host_state = host_state
        self.optimizer = optimizer
        self.transfer = transfer
        self.workers = workers
        self.norms = norms
        self.timeline = timeline
        self.forward_position = forward_position
        self.chunk_numel = chunk_numel
        self.upload = MasterUpload(device, chunk_numel)
        """The h2d thread's chunked copies into slots (Note [Casting uploads])."""
        self.shards = shards
        self.collectives = shards.collectives
        self.store: StateStore = store or HostSlabs(host_state)
        self._entries = {array.name: array.range for array in optimizer.state_arrays}
        self._restoring: dict[tuple[str, str], torch.Tensor] = {}  # the whole targets a resume is filling

    # -- compute needs the unit --------------------------------------------------------------------------
    def slot(self, unit: Unit) -> ParamSlot | None:
        return None

    def before_load(self, unit: Unit) -> None:
        pass

    def load(self, unit: Unit, slot: ParamSlot, ready: Future[None], reuse_after: Event | None) -> Event:
        """h2d thread: wait for the unit's last update, then copy the shard of its master (or of its bf16
        plane) into the slot and all-gather the slot (Note [Sharded stream order])."""
        began = time.perf_counter()
        self.workers.wait(ready, f"the update of {unit.name} before loading it")
        self.timeline.host_span(unit.name, "wait", (time.perf_counter() - began) * 1e3)
        device = self.device
        lo, hi = self.shards[unit.name]
        source = self.host_params.h2d_source(unit)
        target = slot.params[: source.numel()]
        with device.stream("h2d"):
            if reuse_after is not None:
                device.wait_event("h2d", reuse_after)
            start = device.record_event("h2d", timing=self.timeline.enabled)
            self.upload.copy(target, source, lo, hi)
            self.collectives.all_gather_(target, f"the all-gather of {unit.name}'s parameters")
            end = device.record_event("h2d", timing=self.timeline.enabled)
        self.timeline.device_span(unit.name, "h2d", start, end)
        return end

    def begin_step(self, ctx: StepContext) -> None:
        pass

    # -- gradients, main thread --------------------------------------------------------------------------
    def writable_grads(
        self, unit: Unit, slot: ParamSlot, contribution: Contribution, ctx: StepContext
    ) -> torch.Tensor | None:
        self._wait_grads_free(unit, slot)
        return slot.grads

    def contribute(
        self,
        unit: Unit,
        slot: ParamSlot,
        grads: Mapping[str, torch.Tensor | None],
        contribution: Contribution,
        ctx: StepContext,
    ) -> None:
        """Write the gradient, sum it over the ranks into this rank's shard, fold the shard's squared norm
        and stream the shard to the update (Note [Sharded stream order])."""
        self._wait_grads_free(unit, slot)
        write_gradients(unit, slot.grads, grads, add=False)
        device, flat = self.device, slot.grads[: unit.layout.numel]
        lo, hi = self.shards[unit.name]
        with self.collectives.sum_gradient(device, flat, f"the reduce-scatter of {unit.name}'s gradient") as stream:
            if self.norms is not None:
                self.norms.add(unit, flat[lo:hi], first=contribution.starts)
            summed = device.record_event(stream)
        order = (ctx.step, 0, self.forward_position[unit.name], contribution.index)
        slot.grads_free = self.transfer.send(self, unit, slot.grads, summed, contribution, ctx, order)

    def _wait_grads_free(self, unit: Unit, slot: ParamSlot) -> None:
        """Compute stream: wait until the slot's gradient buffer has been streamed out (its last d2h)."""
        if slot.grads_free is not None:
            event = self.workers.wait(slot.grads_free, f"the gradient buffer of {unit.name}")
            self.device.wait_event("compute", event)

    # -- updates, optimizer thread -----------------------------------------------------------------------
    def apply(self, chunk: GradChunk, grad: torch.Tensor) -> None:
        """Take one landed gradient chunk: sum it, or apply the final gradient's ranges the step's clip
        strategy hands back."""
        began = time.perf_counter()
        unit, lo, hi, contribution, ctx = chunk.unit, chunk.start, chunk.end, chunk.contribution, chunk.ctx
        clip = ctx.clip
        if chunk.norm_sq is not None:
            clip.unit_norm(unit, float(chunk.norm_sq), contribution, ctx.step)
        final: Sequence[AppliedRange] = ()
        if contribution.kind is ContributionKind.ONLY:
            final = clip.ranges(unit, lo, hi, grad, summed=False, last_chunk=chunk.last_chunk)
        else:
            shard_lo, shard_hi = self.shards[unit.name]  # only this rank's shard is ever summed
            accum = self.host_state.accumulator(unit, shard_hi - shard_lo)[lo - shard_lo : hi - shard_lo]
            if contribution.starts:
                accum.copy_(grad)
            else:
                accum.add_(grad)
                if contribution.final:
                    final = clip.ranges(unit, lo, hi, accum, summed=True, last_chunk=chunk.last_chunk)
        for applied in final:
            self._step(unit, applied, ctx, grad_scale=applied.coeff)
        self.timeline.host_span(unit.name, "update", (time.perf_counter() - began) * 1e3)
        if chunk.last_chunk and contribution.final:
            if clip.releases_at_last_chunk:
                self._release_state(unit, "backward")
            clip.unit_updated(unit.name, ctx.updated[unit.name])

    def _step(self, unit: Unit, applied: AppliedRange, ctx: StepContext, *, grad_scale: float) -> None:
        lo, hi = applied.start, applied.end
        master = self._master(unit)[lo:hi]
        state = self.host_state.range(self._state(unit), lo, hi)
        if grad_scale == 1.0:  # the keyword only where it matters: optimizer plugins written before it still work
            self.optimizer.step(master, applied.grad, state, lr=ctx.lr, step=ctx.step, decay=applied.decay)
        else:
            self.optimizer.step(
                master, applied.grad, state, lr=ctx.lr, step=ctx.step, decay=applied.decay, grad_scale=grad_scale
            )

    def _master(self, unit: Unit) -> torch.Tensor:
        """The unit's master as the optimizer steps it: an fp32 range, or a split one where the optimizer
        says it takes those (``Optimizer.split_master``, checked by ``check_master_format``)."""
        return cast(torch.Tensor, self.host_params.master(unit))

    def _state(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The unit's optimizer state to update in place."""
        return self.store.acquire(unit)

    def _release_state(self, unit: Unit, read_ahead: ReadAhead) -> None:
        """After the unit's update of the step: the store keeps it (and may read the next one's ahead)."""
        self.store.release(unit, read_ahead)

    # -- the end of a clipped step -----------------------------------------------------------------------
    def finish(self, unit: Unit, ctx: StepContext, correction: Correction) -> None:
        """Held ranges are applied with the final coefficient unless the step is taken back; applied ones
        are corrected unless they stand. Either job resolves the unit's future (Note [Clip rollback
        ordering]); updates that stand were released by the clip strategy (Note [Early clipping decision])."""
        clip, name = ctx.clip, unit.name
        held, applied = clip.held.get(name), clip.applied.get(name)
        submit = self.workers["optimizer"].submit
        if held and correction.kind != "undo":
            coeff = correction.coeff if correction.kind == "rescale" else 1.0
            submit(self.apply_held, unit, held, coeff, ctx, priority=(ctx.step, 1))
        elif correction.kind == "keep":
            if clip.deferred:  # nothing was held (the step halted): nothing to apply
                ctx.updated[name].set_result(None)
        elif applied:
            submit(self.correct, unit, applied, correction, ctx, priority=(ctx.step, 1))
        else:
            ctx.updated[name].set_result(None)

    def apply_held(self, unit: Unit, held: list[AppliedRange], coeff: float, ctx: StepContext) -> None:
        """Optimizer thread: a deferred step's update of ``unit``, every held range scaled by the step's
        final clipping coefficient; then release the unit's next load (Note [Deferred clipped steps])."""
        began = time.perf_counter()
        for applied in held:
            self._step(unit, applied, ctx, grad_scale=coeff)
        self._release_state(unit, "forward")
        self.timeline.host_span(unit.name, "update", (time.perf_counter() - began) * 1e3)
        ctx.updated[unit.name].set_result(None)

    def correct(self, unit: Unit, ranges: list[AppliedRange], correction: Correction, ctx: StepContext) -> None:
        """Optimizer thread: correct the unit's speculative update, then release its next load."""
        began = time.perf_counter()
        master = self._master(unit)
        states = self._state(unit)
        for applied in ranges:
            lo, hi = applied.start, applied.end
            state = self.host_state.range(states, lo, hi)
            self.optimizer.correct(
                master[lo:hi],
                applied.grad,
                state,
                applied=applied.coeff,
                correction=correction,
                lr=ctx.lr,
                step=ctx.step,
                decay=applied.decay,
            )
        self._release_state(unit, None)
        self.timeline.host_span(unit.name, "update", (time.perf_counter() - began) * 1e3)
        ctx.updated[unit.name].set_result(None)

    # -- checkpoints and drains --------------------------------------------------------------------------
    def _entries_of(self, name: str, lo: int, hi: int) -> slice:
        """The entries of array ``name`` that hold parameters ``[lo, hi)`` (int8 state: its blocks)."""
        entries = self._entries.get(name)
        return slice(lo, hi) if entries is None else entries(lo, hi)

    def state_array(self, unit: Unit, name: str) -> torch.Tensor:
        """This rank's shard of the unit's master (in fp32, a split one decoded) or optimizer state: all a
        rank's checkpoint holds (the rest of its state is never written, and the rest of its master is
        another rank's to update)."""
        lo, hi = self.shards[unit.name]
        if name == "master":
            return self.host_params.read(unit, lo, hi)
        return self.store.read(unit, name)[self._entries_of(name, lo, hi)]

    def restore_target(self, unit: Unit, name: str) -> torch.Tensor:
        """This rank's shard of where the array goes: the master's fp32 values (the slab's own range, or a
        split master's decoded copy, which :meth:`restored` stores), or the store's target of the whole
        unit (a tier's staging), which :meth:`restored` then hands back to the store whole."""
        lo, hi = self.shards[unit.name]
        if name == "master":
            return self.host_params.read(unit, lo, hi)
        whole = self.store.restore_target(unit, name)
        self._restoring[(unit.name, name)] = whole
        return whole[self._entries_of(name, lo, hi)]

    def restored(self, unit: Unit, name: str, values: torch.Tensor) -> None:
        """The shard is written; the next load all-gathers the restored shards."""
        if name == "master":  # stored in the master's format (written in place already in fp32)
            self.host_params.write(unit, values, self.shards[unit.name][0])
            return
        self.store.restored(unit, name, self._restoring.pop((unit.name, name)))

    def sync_to_host(self, host_state: HostState | None, *, to_root: bool = False) -> None:
        """Make the host master whole again where other ranks updated part of it (a host all-gather per
        unit; nothing in one process), and copy the optimizer state into ``host_state`` where the store
        keeps it elsewhere. The optimizer state stays sharded. ``to_root``: only rank 0's master is made
        whole (the others keep their shards, Note [Sharded master]), for a run that exports from rank 0."""
        host_params, collectives = self.host_params, self.collectives
        root = not to_root or collectives.rank == 0
        for name in self.shards.partial():
            # The fp32 values: the slab's own range, or a split master decoded (its ranks' tie bits, whose
            # shards need not start on a byte, are then re-encoded rather than merged).
            values = host_params.read(name)
            what = f"the gather of {name}'s master"
            if to_root:
                collectives.gather_to_root_(values, what, host=True)
            else:
                collectives.all_gather_host_(values, what)
            if root:
                host_params.write(name, values)
        self.store.sync_to_host(host_state)

    def flush(self) -> None:
        self.store.flush()
