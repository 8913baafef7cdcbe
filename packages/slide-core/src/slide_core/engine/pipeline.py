"""The per-unit seam of the schedule: what happens to a unit between its gradient and its next use.

A :class:`UnitPipeline` is composed per placement (unit_pipelines.py): an updater, host_pipeline.py (the
master in host RAM, the optimizer state in a store of state_store.py: host RAM or a tier) or
resident_pipeline.py (everything on the device), working on this rank's shard of each unit (shards.py;
the whole unit in one process). The engine only routes each unit's visits to its pipeline:
``slot``/``load`` when compute needs the unit, ``writable_grads``/``contribute`` when its backward has
produced a gradient, ``finish`` when a clipped step is decided. docs/design/engine.md draws the pipelines
and says where a new updater or state store plugs in.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Protocol

import torch

from slide_core.device import Event
from slide_core.optimizer import Correction
from slide_core.unit import Unit

from .context import Contribution, StepContext
from .host_state import HostState
from .slots import ParamSlot

__all__ = ["UnitPipeline", "write_gradients"]


class UnitPipeline(Protocol):
    """What happens to the units of one placement: grads ready -> (d2h) -> update -> params ready.

    Threads: ``load`` runs on the h2d thread; everything else on the main thread, which may issue device
    work on the compute stream (and only there). A pipeline may queue its own work on the engine's d2h and
    optimizer threads. Checkpoint arrays are ``"master"`` or an optimizer state name.
    """

    def slot(self, unit: Unit) -> ParamSlot | None:
        """The device slot ``unit`` always lives in, or None when the engine's window loads it."""
        ...

    def before_load(self, unit: Unit) -> None:
        """Main thread, just before the unit's :meth:`load` is queued on the h2d thread: what must reach
        that thread ahead of the load is queued here."""
        ...

    def load(self, unit: Unit, slot: ParamSlot, ready: Future[None], reuse_after: Event | None) -> Event:
        """h2d thread: once ``ready`` (the unit's last update) is done, bring its parameters into ``slot``
        after ``reuse_after`` (the compute that last read the slot); return the event compute waits for."""
        ...

    def begin_step(self, ctx: StepContext) -> None:
        """Main thread, before the step's first compute."""
        ...

    def writable_grads(
        self, unit: Unit, slot: ParamSlot, contribution: Contribution, ctx: StepContext
    ) -> torch.Tensor | None:
        """The flat buffer this contribution may be written into in place (by the compute that makes it),
        once that buffer is free for compute to write; None when it must be added to what the buffer holds."""
        ...

    def contribute(
        self,
        unit: Unit,
        slot: ParamSlot,
        grads: Mapping[str, torch.Tensor | None],
        contribution: Contribution,
        ctx: StepContext,
    ) -> None:
        """Right after the compute that made ``grads``: put them in the slot's gradient buffer (parameters
        missing or unused get zeros) and start their way to the unit's update."""
        ...

    def finish(self, unit: Unit, ctx: StepContext, correction: Correction) -> None:
        """At the end of a clipped step, once per unit in forward order: the step's decision for the unit's
        update. Resolves ``ctx.updated[unit.name]`` once the update is final."""
        ...

    def state_array(self, unit: Unit, name: str) -> torch.Tensor:
        """This rank's shard of the unit's flat array ``name`` as it is now, for a checkpoint to read
        (pending updates done)."""
        ...

    def restore_target(self, unit: Unit, name: str) -> torch.Tensor:
        """Where a resume writes this rank's shard of the unit's array ``name``; :meth:`restored` follows
        once it is whole."""
        ...

    def restored(self, unit: Unit, name: str, values: torch.Tensor) -> None:
        """The shard of the unit's array ``name`` was written whole into ``values`` (from
        :meth:`restore_target`)."""
        ...

    def sync_to_host(self, host_state: HostState | None, *, to_root: bool = False) -> None:
        """Bring the units' host masters current and whole (gathered from the other ranks; with
        ``to_root`` on rank 0 only), and with ``host_state`` their optimizer state too (this rank's shards)."""
        ...

    def flush(self) -> None:
        """Wait for the pipeline's own background I/O (a tier's write-backs)."""
        ...


def write_gradients(unit: Unit, buffer: torch.Tensor, grads: Mapping[str, torch.Tensor | None], *, add: bool) -> None:
    """Copy (or ``add``) ``grads`` into the unit's flat gradient ``buffer``, in one foreach call.

    Parameters missing from ``grads`` (a tied head's share covers only the borrowed matrix) or unused by
    autograd get zeros when copying, so every contribution covers the whole unit. A gradient the unit's
    forward already wrote into its place (``UnitPipeline.writable_grads``) is not copied onto itself.
    """
    targets, sources = [], []
    for name, view in unit.layout.views(buffer).items():
        grad = grads.get(name)
        if grad is not None:
            if grad.data_ptr() == view.data_ptr() and not add:
                continue  # written in place by the unit's forward
            targets.append(view)
            sources.append(grad)
        elif not add:
            view.zero_()
    if targets:
        (torch._foreach_add_ if add else torch._foreach_copy_)(targets, sources)
