"""Data parallel: host-updated units sharded across ranks, around the :class:`HostPipeline`.

Each rank computes every unit on its own part of the step's batch, and owns one contiguous shard
``[lo, hi)`` of every unit's flat range (``ProcessGroupContext.span``): only that shard of the master is
updated on this rank's host, and only that shard's optimizer state is ever written. Per unit:

- ``contribute`` (main thread): write the gradient into the slot as the host pipeline would, sum it over
  the ranks into this rank's shard (a reduce-scatter, in place in the slot), fold the shard's squared norm
  and hand the shard to the d2h stage (``GradTransfer`` streams ``[lo, hi)`` only); the inner pipeline's
  ``apply`` then updates that range on the optimizer thread, unchanged.
- ``state_array`` / ``restore_target``: this rank's shard of each unit, so a rank's checkpoint is its
  shards (Engine.checkpoint_arrays), which sharded_checkpoint.py reads back at any world size.

The inner pipeline is a :class:`HostPipeline` (host-updated units) or an :class:`OffloadedPipeline`
(tier-offloaded units), whose :class:`OffloadedState` then keeps this rank's shards only on the tier
(``OffloadedState.keep_shards``): its staging stays one unit long, so the update addresses it as in one
process.
- ``load`` (h2d thread): once the unit's last update is done, copy this rank's shard of the master into
  the slot and all-gather the slot, so every rank computes with the whole, updated unit.

Note [Sharded stream order]: on a GPU the reduce-scatter is ordered on the d2h stream (after an event of
the compute that wrote the gradient) and the all-gather on the h2d stream (after the shard's copy), so
the compute stream never waits for a collective; the shard's squared norm is formed on the d2h stream
after the reduce-scatter, and the d2h of the shard waits for that. The one wait of the compute stream is
at the end of the step, before the loss and the norms are read (:meth:`ShardedPipeline.sum_loss_and_norms`).
On the CPU device streams are no-ops and every collective blocks the host thread that issues it.

Note [Sharded master]: a rank never reads its host master outside its shards before a drain: a load
copies ``[lo, hi)`` up and the all-gather fills the rest, the update writes ``[lo, hi)``, a checkpoint reads
``[lo, hi)``, and a device-resident unit's compute copy is all-gathered once at the start
(sharded_resident.py). So a master loaded with ``HostParameters.keep_shards`` (only the shards written),
and pinned shard by shard (``UnitPipelines``), costs each rank 1/N of its bytes: the other pages are never
touched. The drain (:meth:`ShardedPipeline.sync_to_host`) gathers the whole master on every rank, for an
export. Tested by ``test_ranks_match_one_process_at_the_global_batch`` (every rank loads its shards only)
and ``test_a_sharded_master_costs_its_shard`` (tests/core/test_sharded_master.py).

The step's sums over ranks are formed here too: the label tokens that divide the loss (before the first
micro-batch, so every rank scales its gradients by the global count), the loss and the per-unit squared
norms (one all-reduce, with the step's one read), and the host-summed units' squared norms (gradient
accumulation, a tied embedding) once the optimizer thread has summed them. Every clip strategy then sees
global norms, so clipping and the skip of a non-finite step are decided alike on every rank; the
speculative ``c_u`` of each range (Note [Early clipping decision]) is from the shard's own norm, which is
never above the unit's, so the final coefficient still never exceeds it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from slide_core.device import Event
from slide_core.optimizer import Correction
from slide_core.unit import Unit

from .context import Contribution, StepContext
from .host_pipeline import HostPipeline
from .host_state import HostState
from .norms import UnitNorms
from .pipeline import write_gradients
from .slots import ParamSlot
from .workers import Workers

if TYPE_CHECKING:
    from slide_core.distributed import ProcessGroupContext

__all__ = ["ShardedPipeline"]


class ShardedPipeline:
    """A :class:`HostPipeline` whose units are sharded over ``group``'s ranks by ``spans`` (this rank's
    ``[lo, hi)`` of each unit; the ``GradTransfer`` the inner pipeline sends through streams the same
    spans). The inner pipeline keeps the update, the clipping records and the end of a clipped step."""

    def __init__(
        self,
        inner: HostPipeline,
        group: ProcessGroupContext,
        units: Sequence[Unit],
        spans: Mapping[str, tuple[int, int]],
    ) -> None:
        for unit in units:
            lo, hi = spans[unit.name]
            if hi <= lo:
                raise ValueError(
                    f"unit {unit.name} has {unit.layout.numel} elements, too few to give each of {group.world_size} "
                    "ranks a shard"
                )
        self.inner = inner
        self.group = group
        self.units = list(units)
        self.spans = dict(spans)
        self._reduced: Event | None = None  # the last reduce-scatter's event on the d2h stream
        self._restoring: dict[tuple[str, str], torch.Tensor] = {}  # the inner targets a resume is filling

    # -- compute needs the unit --------------------------------------------------------------------------
    def slot(self, unit: Unit) -> ParamSlot | None:
        return None

    def load(self, unit: Unit, slot: ParamSlot, ready: Future[None], reuse_after: Event | None) -> Event:
        """h2d thread: wait for the unit's last update, copy this rank's shard of its master into the slot,
        then all-gather the slot (Note [Sharded stream order])."""
        inner = self.inner
        began = time.perf_counter()
        inner.workers.wait(ready, f"the update of {unit.name} before loading it")
        inner.timeline.host_span(unit.name, "wait", (time.perf_counter() - began) * 1e3)
        device, timing = inner.device, inner.timeline.enabled
        lo, hi = self.spans[unit.name]
        source = inner.host_params.h2d_source(unit)
        target = slot.params[: unit.layout.numel]
        with device.stream("h2d"):
            if reuse_after is not None:
                device.wait_event("h2d", reuse_after)
            start = device.record_event("h2d", timing=timing)
            inner.upload.copy(target, source, lo, hi)
            self.group.all_gather_(target, f"the all-gather of {unit.name}'s parameters")
            loaded = device.record_event("h2d", timing=timing)
        inner.timeline.device_span(unit.name, "h2d", start, loaded)
        return loaded

    def begin_step(self, ctx: StepContext) -> None:
        self.inner.begin_step(ctx)

    # -- gradients, main thread --------------------------------------------------------------------------
    def writable_grads(
        self, unit: Unit, slot: ParamSlot, contribution: Contribution, ctx: StepContext
    ) -> torch.Tensor | None:
        return self.inner.writable_grads(unit, slot, contribution, ctx)

    def contribute(
        self,
        unit: Unit,
        slot: ParamSlot,
        grads: Mapping[str, torch.Tensor | None],
        contribution: Contribution,
        ctx: StepContext,
    ) -> None:
        """Write the gradient, sum it over the ranks into this rank's shard, and stream the shard to the
        inner pipeline's update (Note [Sharded stream order])."""
        inner, device = self.inner, self.inner.device
        self.inner.writable_grads(unit, slot, contribution, ctx)  # the slot's previous gradient has left
        write_gradients(unit, slot.grads, grads, add=False)
        flat = slot.grads[: unit.layout.numel]
        lo, hi = self.spans[unit.name]
        written = device.record_event("compute")
        with device.stream("d2h"):
            device.wait_event("d2h", written)
            self.group.reduce_scatter_(flat, f"the reduce-scatter of {unit.name}'s gradient")
            if inner.norms is not None:
                inner.norms.add(unit, flat[lo:hi], first=contribution.starts)
            reduced = self._reduced = device.record_event("d2h")
        order = (ctx.step, 0, inner.forward_position[unit.name], contribution.index)
        slot.grads_free = inner.transfer.send(inner, unit, slot.grads, reduced, contribution, ctx, order)

    def finish(self, unit: Unit, ctx: StepContext, correction: Correction) -> None:
        self.inner.finish(unit, ctx, correction)

    # -- the step's sums over ranks, main thread ---------------------------------------------------------
    def sum_counts(self, *counts: int) -> list[int]:
        """The step's token counts summed over the ranks (before the first micro-batch: the loss is
        divided by every rank's label tokens)."""
        values = torch.tensor(counts, dtype=torch.int64)
        self.group.all_reduce_host_(values, "the sum of the step's token counts")
        return [int(value) for value in values.tolist()]

    def sum_loss_and_norms(self, loss_sum: torch.Tensor, norms: UnitNorms | None) -> tuple[float, list[float] | None]:
        """The step's loss sum and every unit's squared gradient norm, each summed over the ranks in one
        all-reduce, then read. note: CPU-GPU sync point (the engine's one read per step)."""
        device = self.inner.device
        if self._reduced is not None:  # the norms were formed on the d2h stream (Note [Sharded stream order])
            device.wait_event("compute", self._reduced)
        parts = [loss_sum.reshape(1)] if norms is None else [loss_sum.reshape(1), norms.on_device]
        values = torch.cat(parts)
        self.group.all_reduce_(values, "the all-reduce of the step's loss and gradient norms")
        read = values.tolist()
        return read[0], (read[1:] if norms is not None else None)

    def sum_host_squares(self, ctx: StepContext, workers: Workers, last_d2h: Future[Event] | None) -> None:
        """Sum the host-summed units' squared norms (``ctx.clip.host_sq``) over the ranks, in place,
        before the clip strategy reads them: each rank summed only its shards. Waits for the step's last
        gradient transfer and then for every optimizer job queued by then (a barrier job), which is when
        every host sum of the step is complete (Note [Clip rollback ordering])."""
        host_sq = ctx.clip.host_sq
        names = [name for name in ctx.expected if ctx.summed_on_host(name)]
        if host_sq is None or not names:
            return
        if last_d2h is not None:
            workers.wait(last_d2h, "the gradient transfers of the step")
        barrier = workers["optimizer"].submit(_nothing, priority=(ctx.step, 1))
        workers.wait(barrier, "the host sums of the step's gradients")
        values = torch.tensor([host_sq.get(name, math.nan) for name in names], dtype=torch.float64)
        self.group.all_reduce_host_(values, "the sum of the step's host-side gradient norms")
        host_sq.update(zip(names, values.tolist(), strict=True))

    # -- checkpoints and drains --------------------------------------------------------------------------
    def state_array(self, unit: Unit, name: str) -> torch.Tensor:
        """This rank's shard of the unit's master or optimizer state: all a rank's checkpoint holds (the
        rest of its state slabs is never written, and the rest of its master is another rank's to update)."""
        lo, hi = self.spans[unit.name]
        return self.inner.state_array(unit, name)[lo:hi]

    def restore_target(self, unit: Unit, name: str) -> torch.Tensor:
        """This rank's shard of the inner pipeline's target (a host range, or a tier-offloaded unit's
        staging, which :meth:`restored` then hands to the inner pipeline whole)."""
        lo, hi = self.spans[unit.name]
        if name == "master" and self.inner.host_params.split:
            return torch.empty(hi - lo, dtype=torch.float32)  # encoded by ``restored``
        whole = self._restoring[(unit.name, name)] = self.inner.restore_target(unit, name)
        return whole[lo:hi]

    def restored(self, unit: Unit, name: str, values: torch.Tensor) -> None:
        """The shard is written: the inner pipeline stores its target (a tier keeps the shard only); the
        next load all-gathers the restored shards."""
        if name == "master" and self.inner.host_params.split:
            self.inner.host_params.write(unit, values, self.spans[unit.name][0])
            return
        whole = self._restoring.pop((unit.name, name), None)
        if whole is not None:
            self.inner.restored(unit, name, whole)

    def sync_to_host(self, host_state: HostState | None, *, to_root: bool = False) -> None:
        """Make every rank's host master whole again: each rank updated only its shards, so the rest of
        its slab is as old as the last gather (a host all-gather per unit, through the gloo group). The
        optimizer state stays sharded: a host-updated unit's is already where a checkpoint reads it (this
        rank's shards of the host slabs), a tier-offloaded unit's is copied there by the inner pipeline.
        ``to_root``: only rank 0's master is made whole (the others keep their shards, Note [Sharded
        master]), for a run that exports from rank 0 and ends."""
        host_params, group = self.inner.host_params, self.group
        for unit in self.units:
            what = f"the gather of {unit.name}'s master"
            if not host_params.split:
                if to_root:
                    group.gather_to_root_(host_params.flat(unit), what, host=True)
                else:
                    group.all_gather_host_(host_params.flat(unit), what)
                continue
            # A split master is gathered decoded (one unit's fp32 at a time), so the ranks' tie bits, whose
            # shards need not start on a byte, are re-encoded rather than merged.
            lo, hi = self.spans[unit.name]
            values = host_params.read(unit) if not to_root or group.rank == 0 else host_params.read(unit, lo, hi)
            if to_root and group.rank != 0:
                whole = torch.empty(unit.layout.numel, dtype=torch.float32)  # only [lo, hi) is sent
                whole[lo:hi].copy_(values)
                group.gather_to_root_(whole, what, host=True)
                continue
            if to_root:
                group.gather_to_root_(values, what, host=True)
            else:
                group.all_gather_host_(values, what)
            host_params.write(unit, values)
        self.inner.sync_to_host(host_state)

    def flush(self) -> None:
        self.inner.flush()


def _nothing() -> None:
    """An optimizer-thread job that does nothing: when it is done, every job queued before it is."""
