"""Every unit's pipeline, composed from where the engine's config places the unit.

A unit's pipeline is three independent parts:

- the **updater**, where its update runs: on the host optimizer thread (:class:`HostPipeline`, the
  gradient crosses PCIe), on the device for a unit in ``resident_units`` (:class:`ResidentPipeline`), or
  on the device as the unit streams through it for a unit in ``streamed_units`` (:class:`StreamedPipeline`:
  master and state cross PCIe instead of the gradient);
- for a host-updated unit, the **state store**, where its optimizer state lives between updates: the host
  slabs (:class:`HostSlabs`, RAM or pinned) or a tier for a unit in ``offloaded_units``
  (:class:`TierStore`);
- the **shard**, the part ``[lo, hi)`` of the unit this rank updates, with the collectives that move the
  rest (:class:`UnitShards`): the whole unit and collectives that do nothing in one process.

The host-updated pipelines share the :class:`GradTransfer` (the d2h stage and its pinned ring or store).
:class:`UnitPipelines` is built once per engine run and is the one place a new updater or store is
plugged in: see "Where things plug in" in docs/design/engine.md.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future

import torch

from slide_core.allocation_ledger import AllocationLedger
from slide_core.collectives import Collectives
from slide_core.device import Device, Event
from slide_core.host_params import HostParameters
from slide_core.optimizer import Optimizer
from slide_core.unit import SlideModel, Unit

from .config import EngineConfig
from .context import ClipStrategy, StepContext
from .grad_transfer import GradTransfer
from .host_pipeline import HostPipeline
from .host_span import outside, pinned_spans
from .host_state import HostState
from .layout import RunLayout
from .norms import UnitNorms
from .pipeline import UnitPipeline
from .replacement import StreamedPlacement
from .resident import ResidentUnits
from .resident_pipeline import ResidentPipeline
from .shards import UnitShards
from .slots import ParamSlot
from .state_offload import OffloadedState
from .state_store import HostSlabs, StateStore, TierStore
from .streamed_pipeline import StreamedPipeline
from .timeline import ComputeTimer
from .workers import Workers

__all__ = ["UnitPipelines"]


class UnitPipelines:
    """The pipelines of one engine run, which one owns each unit, and the step's sums over the ranks.

    Building it copies device-resident units to the device, gives back their host pages and pins the
    host-updated units' master shards when the slab is not pinned (Note [Resident host copies]), and zeroes
    a fresh run's host optimizer state after that, so the two never add up in the host's peak. ``ledger``:
    the engine's, which counts the buffers the pipelines allocate and the master's pages they never touch.
    """

    def __init__(
        self,
        model: SlideModel,
        device: Device,
        host_params: HostParameters,
        host_state: HostState,
        optimizer: Optimizer,
        config: EngineConfig,
        workers: Workers,
        timer: ComputeTimer,
        offloaded: OffloadedState | None,
        collectives: Collectives,
        *,
        ledger: AllocationLedger | None = None,
    ) -> None:
        self.layout = RunLayout.of(model, config)
        """Which unit is resident, streamed or host-optimized, and where its state lives (layout.py)."""
        resident, streamed, on_tier = set(self.layout.resident), set(self.layout.streamed), set(self.layout.offloaded)
        streamable = set(self.layout.streamable)  # the streamed path's units, on the device now or not
        self.device, self.host_params, self.collectives = device, host_params, collectives
        self.shards = UnitShards(collectives, model.units)
        """This rank's shard ``[lo, hi)`` of every unit (every unit whole in one process)."""
        self.spans = self.shards.spans
        lean_host = not host_params.is_pinned
        views = {name: host_state.views(name) if host_state.valid[name] else None for name in resident}
        self.residents = ResidentUnits(
            model, config.resident_units, device, host_params, views, optimizer.state_arrays, config.compute_dtype
        )
        ledger = ledger or AllocationLedger()
        self.norms = UnitNorms(device, model.units, ledger=ledger) if UnitNorms.wanted(config) else None
        """Every unit's squared gradient norm of the step (Note [Gradient norm of every step])."""
        chunk_numel = config.transfer_chunk_numel
        device_optimizer = optimizer.device_replica()  # main thread: resident and streamed updates

        # The updater on the device: resident units.
        self.resident = ResidentPipeline(
            self.residents, device_optimizer, host_params, self.norms, timer, chunk_numel,
            lean_host=lean_host, shards=self._shards(collectives, model.units, resident),
        )  # fmt: skip
        sliding = set(self.layout.sliding)
        host_units = [unit for unit in model.units if unit.name in sliding]
        host_spans = {unit.name: self.shards[unit.name] for unit in host_units}
        if lean_host:
            pinned = _pin_shards(device, host_params, model.units, resident, self.shards, self.resident)
            _leave_master_untouched(ledger, host_params, host_spans, pinned)
        host_state.zero_fresh(host_spans)
        self.transfer = GradTransfer(
            device, workers, host_units, config, timer.timeline, self.norms, host_spans, gpu_updated=streamed,
            ledger=ledger,
        )  # fmt: skip

        # The updater on the host, once per state store: the host slabs, a tier.
        def host_pipeline(names: set[str], store: StateStore) -> HostPipeline:
            return HostPipeline(
                device, host_params, host_state, optimizer, self.transfer, workers, self.norms, timer.timeline,
                {unit.name: index for index, unit in enumerate(model.units)}, chunk_numel,
                shards=self._shards(collectives, host_units, names), store=store,
            )  # fmt: skip

        self.host = host_pipeline(set(self.layout.host_optimized) - on_tier - streamable, HostSlabs(host_state))
        self._of: dict[str, UnitPipeline] = dict.fromkeys(resident, self.resident)
        self._of.update((unit.name, self.host) for unit in host_units)
        self.distinct: list[UnitPipeline] = [self.resident, self.host]

        # The updater on the device for units that stream: their state in the host slabs. It owns the
        # streamable units too, which it updates on the host until moved (Note [Re-placement at a step
        # boundary] in replacement.py).
        self.placement = StreamedPlacement(streamable, streamed)
        """Which streamable units are updated on the device now (:meth:`place_streamed`)."""
        self.streamed = StreamedPipeline(
            device, host_params, host_state, optimizer, device_optimizer, self.transfer, workers, self.norms, timer,
            {unit.name: index for index, unit in enumerate(model.units)}, chunk_numel,
            shards=self._shards(collectives, host_units, streamable), staging_sets=config.staging_sets,
            placement=self.placement,
        )  # fmt: skip
        if streamable:
            others = [unit for unit in model.units if unit.name not in streamable]
            elsewhere = [
                (host_params.offset(u) + lo, host_params.offset(u) + hi)
                for u in others
                for lo, hi in [self.shards[u.name]]
            ]
            self.resident.keep_host_pages(*self.streamed.pin_host_ranges(elsewhere))
            self.distinct.append(self.streamed)
            self._of.update(dict.fromkeys(streamable, self.streamed))
        if offloaded is not None:
            tier_shards = self._shards(collectives, host_units, on_tier)
            offloaded.keep_shards(tier_shards.partial())  # the tier keeps this rank's shards only
            tier_units = [unit for unit in host_units if unit.name in on_tier]
            tiered = host_pipeline(on_tier, TierStore(tier_units, offloaded, host_state))
            self.distinct.append(tiered)
            self._of.update(dict.fromkeys(on_tier, tiered))
        self.routes: list[tuple[Unit, UnitPipeline]] = [(unit, self._of[unit.name]) for unit in model.units]
        """Every unit with its pipeline, in forward order."""
        self.fixed: dict[str, ParamSlot] = {name: self.residents.slot(name) for name in self.residents.units}
        """The units that always live in one device slot, never loaded by the window."""
        self.device_updated = frozenset(resident)
        """The units that live on the device (the window never slides them)."""

    @staticmethod
    def _shards(collectives: Collectives, units: Sequence[Unit], names: set[str]) -> UnitShards:
        return UnitShards(collectives, [unit for unit in units if unit.name in names])

    def __getitem__(self, name: str) -> UnitPipeline:
        return self._of[name]

    @property
    def by_name(self) -> dict[str, UnitPipeline]:
        return self._of

    def updated_on_device(self, clip: ClipStrategy, expected: Mapping[str, int]) -> frozenset[str]:
        """The units a step with ``clip`` and ``expected`` contributions updates on the device with their
        final gradient's norm there: the resident ones, and the streamed ones but in a deferred step (Note
        [When a streamed unit is updated on the host] in streamed_pipeline.py) or a summed one in a step
        that speculates (Note [Streamed accumulation])."""
        return self.device_updated | {
            name for name in self.placement.streamed if self.streamed.updates_on_device(clip, expected[name])
        }

    def place_streamed(self, names: Collection[str]) -> tuple[frozenset[str], frozenset[str]]:
        """Between steps, with every update landed: update ``names`` on the device from the next step (Note
        [Re-placement at a step boundary]). Returns the units moved to the device and to the host."""
        return self.placement.move(names)

    def begin_step(self, ctx: StepContext) -> None:
        for pipeline in self.distinct:
            pipeline.begin_step(ctx)
        self.transfer.begin_step()

    # -- the step's sums over the ranks (nothing in one process), main thread ------------------------------
    def sum_counts(self, loss_tokens: int, tokens: int) -> tuple[int, int]:
        """The step's token counts over every rank, before the first micro-batch: every rank's gradients
        are divided by every rank's label tokens."""
        loss_tokens, tokens = self.collectives.sum_counts((loss_tokens, tokens), "the sum of the step's token counts")
        return loss_tokens, tokens

    def sum_loss_and_norms(self, loss_sum: torch.Tensor) -> tuple[float, list[float] | None]:
        """The step's summed loss and every unit's device-side squared gradient norm (Note [Gradient norm
        of every step]), summed over the ranks in one all-reduce, then read in one go. note: CPU-GPU sync
        point (the engine's one read per step, for the reported loss)."""
        norms = self.norms
        self.collectives.wait_gradient_sums(self.device)  # norms formed beside the sums (Note [Sharded stream order])
        values = loss_sum.reshape(1) if norms is None else torch.cat((loss_sum.reshape(1), norms.on_device))
        self.collectives.all_reduce_(values, "the all-reduce of the step's loss and gradient norms")
        read = values.tolist()
        return read[0], (read[1:] if norms is not None else None)

    def sum_host_squares(self, ctx: StepContext, workers: Workers, last_d2h: Future[Event] | None) -> None:
        """Sum the host-summed units' squared norms (``ctx.clip.host_sq``) over the ranks, in place, before
        the clip strategy reads them: each rank summed only its shards. Before the sum, waits for the
        step's last gradient transfer and then for every optimizer job queued by then (a barrier job),
        which is when every host sum of the step is complete (Note [Clip rollback ordering])."""
        host_sq = ctx.clip.host_sq
        if host_sq is None:
            return

        def summed_on_host() -> None:
            if last_d2h is not None:
                workers.wait(last_d2h, "the gradient transfers of the step")
            barrier = workers["optimizer"].submit(_nothing, priority=(ctx.step, 1))
            workers.wait(barrier, "the host sums of the step's gradients")

        names = [name for name in ctx.expected if ctx.summed_on_host(name)]
        what = "the sum of the step's host-side gradient norms"
        self.collectives.sum_values(host_sq, names, what, ready=summed_on_host)

    # -- drains -------------------------------------------------------------------------------------------
    def sync_to_host(self, host_state: HostState | None, *, to_root: bool = False) -> None:
        """Every pipeline's host copies current: the masters gathered whole on every rank, or with
        ``to_root`` on rank 0 alone (one process holds them whole already)."""
        if not to_root or self.collectives.rank == 0:
            self.host_params.keep_shards(None)  # the gathers write every unit whole (Note [Sharded master])
        for pipeline in self.distinct:
            pipeline.sync_to_host(host_state, to_root=to_root)

    def flush(self) -> None:
        for pipeline in self.distinct:
            pipeline.flush()

    def unpin_host_state(self) -> None:
        """Before the host optimizer state is dropped: give back the pins on it (streamed units)."""
        self.streamed.unpin_host_ranges()


def _pin_shards(
    device: Device,
    host_params: HostParameters,
    units: Sequence[Unit],
    resident: set[str],
    shards: UnitShards,
    resident_pipeline: ResidentPipeline,
) -> list[torch.Tensor]:
    """Page-lock this rank's shards of the copied plane, one registration per span of
    :func:`~.host_span.pinned_spans` (Note [One registration per allocation] in host_span.py): its shards
    joined where contiguous or where only resident units lie between them. The resident units' pages
    outside the spans are given back first, since a page-locked registration may keep nearby pages; those
    inside them stay locked, and the resident pipeline keeps them at every later release too."""
    extents, bridges = [], []
    for unit in units:
        start, end = host_params.extent(unit)
        if unit.name in resident:
            bridges.append((start, end))
        else:
            lo, hi = shards[unit.name]
            extents.append((start + lo, start + hi))
    pinned = [host_params.h2d_span(start, end) for start, end in pinned_spans(extents, bridges)]
    resident_pipeline.keep_host_pages(*pinned)
    resident_pipeline.release_host_masters()
    for span in pinned:
        device.pin_host_range(span)
    return pinned


def _leave_master_untouched(
    ledger: AllocationLedger,
    host_params: HostParameters,
    spans: Mapping[str, tuple[int, int]],
    pinned: Sequence[torch.Tensor],
) -> None:
    """Tell the ledger which of an unpinned master's pages this rank never touches before a drain (Note
    [Sharded master] in host_pipeline.py): every plane outside its shards ``spans`` of the sliding units and
    outside the page-locked spans ``pinned``, i.e. the other ranks' shards and the device-resident units'
    ranges whose pages were given back."""
    kept = [*pinned]
    for name, (lo, hi) in spans.items():
        start = host_params.offset(name)
        kept.extend(host_params.store.page_ranges(start + lo, start + hi))
    for plane in host_params.planes.values():
        for part in outside(plane, kept):
            ledger.leave_untouched(part)


def _nothing() -> None:
    """An optimizer-thread job that does nothing: when it is done, every job queued before it is."""
