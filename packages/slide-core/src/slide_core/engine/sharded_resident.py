"""Data parallel for device-resident units: each rank updates its shard on the device, then the ranks
all-gather the unit's compute-dtype parameters.

A resident unit lives in one device slot with its fp32 master and optimizer state beside it
(resident_pipeline.py). Under data parallel every rank keeps that whole layout (the GPU holds what one
process would), but owns one shard ``[lo, hi)`` of the unit, as for host-updated units
(sharded_pipeline.py):

- ``contribute`` (main thread, compute stream): the rank's gradient of the unit is summed locally as one
  process sums it (in the slot, or in the fp32 accumulator with several micro-batches); once it is
  final, one reduce-scatter sums it over the ranks into ``[lo, hi)``; the shard's squared norm, clip
  coefficient and optimizer update touch ``[lo, hi)`` only; the shard of the compute copy is refreshed
  from the master and the slot all-gathered, so every rank computes the next use with the whole,
  updated unit.
- ``finish`` (a clipped step's correction) corrects the shard and all-gathers again.
- ``state_array`` / ``restore_target``: the shard, so a checkpoint of a rank is its shards of every unit
  whatever the unit's placement (sharded_checkpoint.py reads them back at any world size).
- ``sync_to_host`` (a drain) all-gathers the fp32 master on the device before copying it to the host.
- At the start every unit's compute copy is all-gathered once: the host master it was copied from may
  hold only this rank's shards (Note [Sharded master] in sharded_pipeline.py).

Clipping sees the global norm, as with host units: each rank's squared norm of its shard is summed with
the step's loss (``ShardedPipeline.sum_loss_and_norms``), and the speculative coefficient of a shard
(from the shard's own norm, never above the unit's) is corrected at the end of the step like any other.

Every collective here is issued by the main thread in schedule order, the same on every rank, through
the main thread's group (Note [One group per issuing thread] in slide_core/distributed.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from slide_core.optim.state_formats import slice_state
from slide_core.unit import Unit

from .context import Contribution, StepContext
from .host_state import HostState
from .pipeline import write_gradients
from .resident import ResidentUnit
from .resident_pipeline import ResidentPipeline
from .slots import ParamSlot

if TYPE_CHECKING:
    from slide_core.distributed import ProcessGroupContext

__all__ = ["ShardedResidentPipeline"]


class ShardedResidentPipeline(ResidentPipeline):
    """A :class:`ResidentPipeline` whose units are sharded over ``group``'s ranks by ``spans``."""

    def __init__(
        self, *args: Any, group: ProcessGroupContext, spans: Mapping[str, tuple[int, int]], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.spans = {name: spans[name] for name in self.units.units}
        for name, (lo, hi) in self.spans.items():
            if hi <= lo:
                raise ValueError(
                    f"unit {name} has {self.units.units[name].unit.layout.numel} elements, too few to give each "
                    f"of {group.world_size} ranks a shard"
                )
        for resident in self.units.units.values():  # the host master may hold only the shards (Note [Sharded master])
            self._gather(resident)

    # -- gradients, main thread (compute stream) -------------------------------------------------------
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
            flat = final[: unit.layout.numel]
            self.group.reduce_scatter_(flat, f"the reduce-scatter of {unit.name}'s gradient")
            lo, hi = self.spans[unit.name]
            shard = flat[lo:hi]
            coeff = ctx.clip.device_coefficient(self.norms, unit, shard)
            for a, b, decay in self._shard_pieces(unit):
                state = slice_state(self.optimizer.state_arrays, resident.state, a, b)
                grad = flat[a:b] if coeff is None else self._scaled(flat[a:b], coeff)
                self.optimizer.step(resident.master[a:b], grad, state, lr=ctx.lr, step=ctx.step, decay=decay)
            if coeff is None:
                if self.norms is not None:  # the final gradient, which the optimizer step did not write
                    self.norms.add(unit, shard, first=True)
                ctx.updated[unit.name].set_result(None)
            self._gather(resident)
        self.timer.stop(unit.name, "update", start)

    def _shard_pieces(self, unit: Unit) -> list[tuple[int, int, bool]]:
        """The unit's update pieces (``_pieces``) cut to this rank's shard."""
        lo, hi = self.spans[unit.name]
        return [(max(a, lo), min(b, hi), decay) for a, b, decay in self._pieces(unit) if max(a, lo) < min(b, hi)]

    def _gather(self, resident: ResidentUnit) -> None:
        """Refresh the shard of the compute copy from the master, then all-gather the whole unit."""
        name = resident.unit.name
        lo, hi = self.spans[name]
        params = resident.slot.params[: resident.unit.layout.numel]
        params[lo:hi].copy_(resident.master[lo:hi])
        self.group.all_gather_main_(params, f"the all-gather of {name}'s parameters")

    # -- the end of a clipped step: ResidentPipeline.finish over the shard, then the gather ---------------
    def _correction_pieces(self, unit: Unit) -> list[tuple[int, int, bool]]:
        return self._shard_pieces(unit)

    def _publish(self, resident: ResidentUnit) -> None:
        self._gather(resident)

    def state_array(self, unit: Unit, name: str) -> torch.Tensor:
        lo, hi = self.spans[unit.name]
        return super().state_array(unit, name)[lo:hi]

    def restore_target(self, unit: Unit, name: str) -> torch.Tensor:
        return self.state_array(unit, name)

    def restored(self, unit: Unit, name: str, values: torch.Tensor) -> None:
        if name == "master":  # every rank restores the same arrays in the same order: gather here
            self._gather(self.units.units[unit.name])

    def sync_to_host(self, host_state: HostState | None, *, to_root: bool = False) -> None:
        """Gather the fp32 masters on the device (each rank updated its shard only), then copy them to
        the host as one process does; the optimizer state stays sharded. ``to_root``: to rank 0 only,
        and only rank 0 copies them whole to its host; the others copy their shards (Note [Sharded
        master])."""
        for name, resident in self.units.units.items():
            what = f"the gather of {name}'s master"
            if to_root:
                self.group.gather_to_root_(resident.master, what, host=False)
            else:
                self.group.all_gather_main_(resident.master, what)
        if not to_root or self.group.rank == 0:
            super().sync_to_host(host_state)
            return
        for name, resident in self.units.units.items():
            lo, hi = self.spans[name]
            self.host_params.write(name, resident.master[lo:hi], lo)
