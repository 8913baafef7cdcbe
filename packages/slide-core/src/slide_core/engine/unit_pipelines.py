"""Every unit's pipeline, chosen by where the engine's config places the unit.

A unit in ``resident_units`` gets the :class:`ResidentPipeline`, one in ``offloaded_units`` the
:class:`OffloadedPipeline`, any other the :class:`HostPipeline`; the two host-side ones share the
:class:`GradTransfer` (the d2h stage and its pinned ring or store). :class:`UnitPipelines` is built once per
engine run and is the one place a new placement, or a wrapper around a pipeline (a sharded one for data
parallel), is plugged in: see "Where things plug in" in docs/design/engine.md.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from slide_core.device import Device
from slide_core.host_params import HostParameters
from slide_core.optimizer import Optimizer
from slide_core.unit import SlideModel, Unit

from .config import EngineConfig
from .context import StepContext
from .grad_transfer import GradTransfer
from .host_pipeline import HostPipeline
from .host_state import HostState
from .norms import UnitNorms
from .offloaded_pipeline import OffloadedPipeline
from .pipeline import UnitPipeline
from .resident import ResidentUnits
from .resident_pipeline import ResidentPipeline
from .sharded_pipeline import ShardedPipeline
from .sharded_resident import ShardedResidentPipeline
from .slots import ParamSlot
from .state_offload import OffloadedState
from .timeline import ComputeTimer
from .workers import Workers

if TYPE_CHECKING:
    from slide_core.distributed import ProcessGroupContext

__all__ = ["UnitPipelines"]


class UnitPipelines:
    """The pipelines of one engine run, and which one owns each unit.

    Building it copies device-resident units to the device, gives back their host pages and pins the
    host-updated units' master ranges when the slab is not pinned (Note [Resident host copies]), and zeroes
    a fresh run's host optimizer state after that, so the two never add up in the host's peak.
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
        group: ProcessGroupContext | None = None,
    ) -> None:
        """``group``: the ranks of a data-parallel run (world size > 1); every unit is then sharded across
        them, whatever its placement: host-updated and tier-offloaded units by :class:`ShardedPipeline`
        wrappers (sharded_pipeline.py), device-resident ones by :class:`ShardedResidentPipeline`."""
        resident = set(config.resident_units)
        self.host_params = host_params
        lean_host = not host_params.is_pinned
        views = {name: host_state.views(name) if host_state.valid[name] else None for name in resident}
        self.residents = ResidentUnits(
            model, config.resident_units, device, host_params, views, optimizer.state_arrays, config.compute_dtype
        )
        self.norms = UnitNorms(device, model.units) if UnitNorms.wanted(config) else None
        """Every unit's squared gradient norm of the step (Note [Gradient norm of every step])."""
        timeline = timer.timeline
        chunk_numel = config.transfer_chunk_numel
        self.spans = {unit.name: group.span(unit.layout.numel) for unit in model.units} if group is not None else None
        """This rank's shard ``[lo, hi)`` of every unit under data parallel (None in a single-process run)."""
        parts = (self.residents, optimizer.device_replica(), host_params, self.norms, timer, chunk_numel)
        if group is None:
            self.resident = ResidentPipeline(*parts, lean_host=lean_host)
        else:
            assert self.spans is not None
            self.resident = ShardedResidentPipeline(*parts, lean_host=lean_host, group=group, spans=self.spans)
        if lean_host:  # give pages back before pinning: a page-locked registration may keep nearby pages
            self.resident.release_host_masters()
            for is_host_updated, run in itertools.groupby(model.units, key=lambda unit: unit.name not in resident):
                if not is_host_updated:
                    continue
                units = list(run)
                if self.spans is None:  # one registration per contiguous run of the slab
                    device.pin_host_range(host_params.h2d_span(units[0], units[-1]))
                    continue
                for unit in units:  # data parallel: the shards only (Note [Sharded master])
                    lo, hi = self.spans[unit.name]
                    device.pin_host_range(host_params.h2d_source(unit)[lo:hi])
        host_units = [unit for unit in model.units if unit.name not in resident]
        spans = None if self.spans is None else {unit.name: self.spans[unit.name] for unit in host_units}
        host_state.zero_fresh(spans)
        self.transfer = GradTransfer(device, workers, host_units, config, timeline, self.norms, spans)
        host: dict[str, Any] = dict(
            device=device, host_params=host_params, host_state=host_state, optimizer=optimizer,
            transfer=self.transfer, workers=workers, norms=self.norms, timeline=timeline,
            forward_position={unit.name: index for index, unit in enumerate(model.units)}, chunk_numel=chunk_numel,
        )  # fmt: skip
        self.host = HostPipeline(**host)
        self.sharded: ShardedPipeline | None = None
        """The data-parallel wrapper of the host pipeline, which then owns the host units (None in a
        single-process run)."""
        host_route: UnitPipeline = self.host
        on_tier = [unit for unit in model.units if offloaded is not None and unit.name in offloaded]
        if group is not None:
            assert spans is not None
            in_ram = [unit for unit in host_units if unit not in on_tier]
            host_route = self.sharded = ShardedPipeline(self.host, group, in_ram, spans)
        self._of: dict[str, UnitPipeline] = dict.fromkeys(resident, self.resident)
        self.distinct: list[UnitPipeline] = [self.resident, host_route]
        if offloaded is not None:
            if group is not None:  # the tier keeps this rank's shards only
                assert spans is not None
                offloaded.keep_shards(spans)
            offloaded_route: UnitPipeline = OffloadedPipeline(on_tier, offloaded, **host)
            if group is not None:
                assert spans is not None
                offloaded_route = ShardedPipeline(offloaded_route, group, on_tier, spans)  # type: ignore[arg-type]
            self.distinct.append(offloaded_route)
            self._of.update(dict.fromkeys((unit.name for unit in on_tier), offloaded_route))
        self.routes: list[tuple[Unit, UnitPipeline]] = [
            (unit, self._of.setdefault(unit.name, host_route)) for unit in model.units
        ]
        """Every unit with its pipeline, in forward order."""
        self.fixed: dict[str, ParamSlot] = {name: self.residents.slot(name) for name in self.residents.units}
        """The units that always live in one device slot, never loaded by the window."""
        self.device_updated = frozenset(resident)

    def __getitem__(self, name: str) -> UnitPipeline:
        return self._of[name]

    @property
    def by_name(self) -> dict[str, UnitPipeline]:
        return self._of

    def begin_step(self, ctx: StepContext) -> None:
        for pipeline in self.distinct:
            pipeline.begin_step(ctx)
        self.transfer.begin_step()

    def sync_to_host(self, host_state: HostState | None, *, to_root: bool = False) -> None:
        """Every pipeline's host copies current; with data parallel the masters gathered on every rank,
        or with ``to_root`` on rank 0 alone (every pipeline is a sharded one then)."""
        if self.spans is None:
            for pipeline in self.distinct:
                pipeline.sync_to_host(host_state)
            return
        if not to_root or self.sharded is None or self.sharded.group.rank == 0:
            self.host_params.keep_shards(None)  # the gathers write every unit whole (Note [Sharded master])
        for pipeline in self.distinct:
            pipeline.sync_to_host(host_state, to_root=to_root)  # type: ignore[call-arg]

    def flush(self) -> None:
        for pipeline in self.distinct:
            pipeline.flush()
