"""Device-resident units: master, optimizer state and gradient stay on the device (resident.py), and each
unit is updated on the compute stream right after its backward.

Stream order alone makes every later read of the unit's parameters see the new values (Note [Resident
update ordering] in docs/design/engine.md); nothing crosses PCIe and no thread is involved. With one
micro-batch per step a tied embedding's two contributions are summed in its slot instead of an fp32
accumulator (Note [Tied gradient in the slot]). The host copy of a master is current only after a drain,
and its pages are given back to the OS in between when the slab is not pinned (Note [Resident host
copies]).

The pipeline works on this rank's shard ``[lo, hi)`` of each unit (shards.py): every rank keeps the whole
layout on its device (the GPU holds what one process would), sums a unit's gradient locally as one process
does, and once it is final sums it over the ranks into the shard (one reduce-scatter on the compute
stream); the shard's squared norm, clip coefficient, update and correction touch ``[lo, hi)`` only, and the
shard of the compute copy is refreshed from the master and the slot all-gathered, so every rank computes
the next use with the whole, updated unit. A checkpoint holds the shard; a drain all-gathers the fp32
master on the device before copying it to the host; at the start every compute copy is all-gathered once
(the host master it came from may hold only this rank's shards, Note [Sharded master] in
host_pipeline.py). In one process the shard is the unit and none of these collectives does anything.
Every collective here is issued by the main thread in schedule order, the same on every rank (Note [One
group per issuing thread] in slide_core/distributed.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future

import torch

from slide_core.device import Event
from slide_core.host_memory import release_pages
from slide_core.host_params import HostParameters
from slide_core.optim.state_formats import slice_state
from slide_core.optimizer import Correction, Optimizer
from slide_core.unit import Unit

from .clipping import ScaledGrads
from .context import Contribution, ContributionKind, StepContext
from .host_span import outside
from .host_state import HostState
from .norms import UnitNorms
from .pipeline import write_gradients
from .resident import ResidentUnit, ResidentUnits
from .shards import UnitShards
from .slots import ParamSlot
from .timeline import ComputeTimer

__all__ = ["ResidentPipeline"]

log = logging.getLogger(__name__)


class ResidentPipeline:
    """Updates the device-resident units on the compute stream (main thread).

    ``optimizer`` is used from the main thread only (``Optimizer.device_replica`` of the host one);
    ``lean_host``: the host slab is not pinned, so the pages of resident masters can be given back;
    ``shards``: this rank's shard of each unit.
    """

    def __init__(
        self,
        units: ResidentUnits,
        optimizer: Optimizer,
        host_params: HostParameters,
        norms: UnitNorms | None,
        timer: ComputeTimer,
        chunk_numel: int,
        *,
        lean_host: bool,
        shards: UnitShards,
    ) -> None:
        self.units = units
        self.optimizer = optimizer
        self.host_params = host_params
        self.norms = norms
        self.timer = timer
        self.chunk_numel = chunk_numel  # bounds the fp32 scratch of scaled gradients and of corrections
        self.lean_host = lean_host
        self.kept_host: list[torch.Tensor] = []
        """The page-locked spans of the host master (Note [One registration per allocation]): resident pages
        under them are never given back."""
        self._host_current = False
        self._scaled = ScaledGrads()
        self.shards = shards
        self.collectives = shards.collectives
        self._entries = {array.name: array.range for array in optimizer.state_arrays}
        for name, resident in units.units.items():  # the host master may hold only the shards (Note [Sharded master])
            self.collectives.all_gather_main_(resident.slot.params, f"the all-gather of {name}'s parameters")

    @staticmethod
    def optimizer_range_numel(max_unit_numel: int, chunk_numel: int, *, clipping: bool) -> int:
        """The longest range this pipeline hands its optimizer: a decay range of a unit, or with clipping
        a piece of at most ``chunk_numel`` (``_step_scaled``). What ``Optimizer.device_scratch_bytes`` is
        asked for."""
        return min(max_unit_numel, chunk_numel) if clipping else max_unit_numel

    @staticmethod
    def scratch_bytes(max_unit_numel: int, chunk_numel: int, *, clipping: bool) -> int:
        """Device bytes this pipeline itself allocates beyond the units' buffers (``ResidentUnits``) and
        the optimizer's scratch: with clipping, the fp32 ``coeff * grad`` of one piece (``ScaledGrads``)."""
        return 4 * min(max_unit_numel, chunk_numel) if clipping else 0

    # -- compute needs the unit --------------------------------------------------------------------------
    def slot(self, unit: Unit) -> ParamSlot | None:
        return self.units.slot(unit.name)

    def before_load(self, unit: Unit) -> None:
        raise AssertionError(f"{unit.name} lives on the device and is never loaded")

    def load(self, unit: Unit, slot: ParamSlot, ready: Future[None], reuse_after: Event | None) -> Event:
        raise AssertionError(f"{unit.name} lives on the device and is never loaded")

    def begin_step(self, ctx: StepContext) -> None:
        if self._host_current:
            self.release_host_masters()  # the device masters move on from here

    # -- gradients, main thread (compute stream) -------------------------------------------------------
    @staticmethod
    def _sums_in_slot(ctx: StepContext) -> bool:
        """Note [Tied gradient in the slot]: with one micro-batch, later contributions add to the first."""
        return ctx.micro_batches == 1

    def writable_grads(
        self, unit: Unit, slot: ParamSlot, contribution: Contribution, ctx: StepContext
    ) -> torch.Tensor | None:
        return None if self._sums_in_slot(ctx) and not contribution.starts else slot.grads

    def contribute(
        self,
        unit: Unit,
        slot: ParamSlot,
        grads: Mapping[str, torch.Tensor | None],
        contribution: Contribution,
        ctx: StepContext,
    ) -> None:
        in_slot = self._sums_in_slot(ctx)
        write_gradients(unit, slot.grads, grads, add=in_slot and not contribution.starts)
        start = self.timer.start()
        resident = self.units.units[unit.name]
        final = self._final_gradient(resident, contribution, in_slot)
        if final is not None:
            self.collectives.reduce_scatter_(final, f"the reduce-scatter of {unit.name}'s gradient")
            lo, hi = self.shards[unit.name]
            shard = final[lo:hi]
            coeff = ctx.clip.device_coefficient(self.norms, unit, shard)
            if coeff is None:  # final as applied
                self._step(resident, final, ctx)
                if self.norms is not None:  # the final gradient, which the optimizer step did not write
                    self.norms.add(unit, shard, first=True)
                ctx.updated[unit.name].set_result(None)
            else:
                self._step_scaled(resident, final, coeff, ctx)
        self.timer.stop(unit.name, "update", start)

    def _final_gradient(self, resident: ResidentUnit, contribution: Contribution, in_slot: bool) -> torch.Tensor | None:
        """Fold the contribution in the slot into the unit's sum; the final gradient once it is complete."""
        grads = resident.slot.grads
        if in_slot or contribution.kind is ContributionKind.ONLY:
            return grads if contribution.final else None
        accum = self.units.accumulator(resident.unit.name)
        if contribution.starts:
            accum.copy_(grads)
            return None
        accum.add_(grads)
        return accum if contribution.final else None

    def _step(self, resident: ResidentUnit, grad: torch.Tensor, ctx: StepContext) -> None:
        """The update of the unit's shard, as it is: one optimizer call per decay range."""
        decay_numel, numel = resident.unit.layout.decay_numel, resident.unit.layout.numel
        ranges = ((0, decay_numel, True), (decay_numel, numel, False))
        for start, end, decay in self.shards.cut(resident.unit.name, ranges):
            state = slice_state(self.optimizer.state_arrays, resident.state, start, end)
            self.optimizer.step(
                resident.master[start:end], grad[start:end], state, lr=ctx.lr, step=ctx.step, decay=decay
            )
        self._publish(resident)

    def _step_scaled(self, resident: ResidentUnit, grad: torch.Tensor, coeff: torch.Tensor, ctx: StepContext) -> None:
        """The update of the unit's shard with ``coeff * grad`` (``coeff`` on the device), in pieces so the
        fp32 scratch stays small."""
        for lo, hi, decay in self._shard_pieces(resident.unit):
            state = slice_state(self.optimizer.state_arrays, resident.state, lo, hi)
            scaled = self._scaled(grad[lo:hi], coeff)
            self.optimizer.step(resident.master[lo:hi], scaled, state, lr=ctx.lr, step=ctx.step, decay=decay)
        self._publish(resident)

    def _pieces(self, unit: Unit) -> list[tuple[int, int, bool]]:
        """``[lo, hi)`` pieces of at most ``chunk_numel`` that never straddle the unit's decay boundary."""
        decay_numel, numel = unit.layout.decay_numel, unit.layout.numel
        out: list[tuple[int, int, bool]] = []
        for start, end, decay in ((0, decay_numel, True), (decay_numel, numel, False)):
            out.extend((lo, min(end, lo + self.chunk_numel), decay) for lo in range(start, end, self.chunk_numel))
        return out

    def _shard_pieces(self, unit: Unit) -> list[tuple[int, int, bool]]:
        """:meth:`_pieces` cut to this rank's shard."""
        return self.shards.cut(unit.name, self._pieces(unit))

    # -- the end of a clipped step ---------------------------------------------------------------------
    def finish(self, unit: Unit, ctx: StepContext, correction: Correction) -> None:
        """Correct the unit's speculative update on the compute stream, before any of the next step's
        compute is issued (Note [Clip rollback ordering]); release it."""
        if correction.kind != "keep":
            resident = self.units.units[unit.name]
            summed_in_accum = ctx.expected[unit.name] > 1 and not self._sums_in_slot(ctx)
            grad = resident.accum if summed_in_accum else resident.slot.grads
            assert grad is not None and self.norms is not None
            start = self.timer.start()
            applied = self.norms.coefficient(unit)
            for lo, hi, decay in self._shard_pieces(unit):
                state = slice_state(self.optimizer.state_arrays, resident.state, lo, hi)
                self.optimizer.correct(
                    resident.master[lo:hi],
                    grad[lo:hi],
                    state,
                    applied=applied,
                    correction=correction,
                    lr=ctx.lr,
                    step=ctx.step,
                    decay=decay,
                )
            self._publish(resident)
            self.timer.stop(unit.name, "update", start)
        ctx.updated[unit.name].set_result(None)

    # -- checkpoints, drains and the host copies -------------------------------------------------------
    def _publish(self, resident: ResidentUnit) -> None:
        """Bring the compute copy up to date with the master after an update: the shard from the master,
        the rest from the other ranks."""
        name = resident.unit.name
        lo, hi = self.shards[name]
        resident.slot.params[lo:hi].copy_(resident.master[lo:hi])
        self.collectives.all_gather_main_(resident.slot.params, f"the all-gather of {name}'s parameters")

    def state_array(self, unit: Unit, name: str) -> torch.Tensor:
        """This rank's shard of the unit's master or optimizer state."""
        resident = self.units.units[unit.name]
        lo, hi = self.shards[unit.name]
        if name == "master":
            return resident.master[lo:hi]
        entries = self._entries.get(name)
        return resident.state[name][slice(lo, hi) if entries is None else entries(lo, hi)]

    def restore_target(self, unit: Unit, name: str) -> torch.Tensor:
        return self.state_array(unit, name)

    def restored(self, unit: Unit, name: str, values: torch.Tensor) -> None:
        if name == "master":  # every rank restores the same arrays in the same order: gather here
            self._publish(self.units.units[unit.name])

    def sync_to_host(self, host_state: HostState | None, *, to_root: bool = False) -> None:
        """Gather the fp32 masters on the device (each rank updated its shard only; nothing to gather in
        one process), then copy them to the host; the optimizer state stays sharded. ``to_root``: to rank
        0 only, and only rank 0 copies them whole to its host; the others copy their shards (Note
        [Sharded master])."""
        collectives = self.collectives
        for name, resident in self.units.units.items():
            what = f"the gather of {name}'s master"
            if to_root:
                collectives.gather_to_root_(resident.master, what, host=False)
            else:
                collectives.all_gather_main_(resident.master, what)
        if to_root and collectives.rank != 0:
            for name, resident in self.units.units.items():
                lo, hi = self.shards[name]
                self.host_params.write(name, resident.master[lo:hi], lo)
            return
        views = None if host_state is None else {name: host_state.views(name) for name in self.units.units}
        self.units.sync_to_host(views)
        self._host_current = True  # until the next step (Note [Resident host copies])

    def flush(self) -> None:
        pass  # stream order: the device is synchronized by the engine's wait_idle

    def keep_host_pages(self, *pinned: torch.Tensor) -> None:
        """From now on, :meth:`release_host_masters` leaves the pages under ``pinned`` (spans the engine
        page-locks, Note [One registration per allocation] in host_span.py) resident: a locked page cannot be
        given back, and a resident unit's range inside a span stays with it."""
        self.kept_host.extend(pinned)

    def release_host_masters(self) -> None:
        """Note [Resident host copies]: give the pages of the resident units' host masters back to the OS
        when the slab is not pinned (their values live on the device), except those under
        :attr:`kept_host`."""
        if self.lean_host:
            for name in self.units.units:
                # every plane of the master's format, less the parts the page-locked spans hold
                ranges = [part for r in self.host_params.unit_ranges(name) for part in outside(r, self.kept_host)]
                nbytes = sum(r.numel() * r.element_size() for r in ranges)
                if sum(release_pages(r) for r in ranges) == 0 and nbytes >= 1 << 22:
                    log.warning(
                        "could not give back the host pages of %s (madvise failed): host memory will run "
                        "%.2f GiB above the plan",
                        name,
                        nbytes / 2**30,
                    )
        self._host_current = False
