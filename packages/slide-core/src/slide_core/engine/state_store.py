"""Where a host-updated unit's optimizer state lives between its updates: the state part of its pipeline.

:class:`HostSlabs` keeps it in the host slabs (``HostState``, in RAM, pinned or not); :class:`TierStore`
on a storage tier (NVMe), staged through host buffers around each update (state_offload.py). The master
stays in host RAM either way: a tier moves the optimizer state only. The host pipeline (host_pipeline.py)
updates through either one alike.

While one unit is updated from a tier the next one's state is read ahead: the next in backward order as
gradients land, the next in forward order for a deferred step's held updates (Note [Deferred clipped
steps] in docs/design/engine.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal, Protocol

import torch

from slide_core.unit import Unit

from .host_state import HostState
from .state_offload import OffloadedState

__all__ = ["HostSlabs", "ReadAhead", "StateStore", "TierStore"]

ReadAhead = Literal["backward", "forward"] | None
"""After a unit's update, which unit's state to read ahead: the next in backward order (gradients landing),
in forward order (a deferred step's updates), or none."""


class StateStore(Protocol):
    """The optimizer state of a pipeline's units, each array one whole unit long (a data-parallel rank
    updates, reads and restores its shard of it). ``acquire``/``release`` run on the optimizer thread,
    the rest on the main thread."""

    def acquire(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The unit's state to update in place, until :meth:`release`."""
        ...

    def release(self, unit: Unit, read_ahead: ReadAhead) -> None:
        """After the unit's update: keep what was written and read ahead the ``read_ahead`` next unit's."""
        ...

    def read(self, unit: Unit, name: str) -> torch.Tensor:
        """The unit's array ``name`` as it is now (for a checkpoint)."""
        ...

    def restore_target(self, unit: Unit, name: str) -> torch.Tensor:
        """Where a resume writes the unit's array ``name``; :meth:`restored` follows."""
        ...

    def restored(self, unit: Unit, name: str, values: torch.Tensor) -> None:
        """``values`` (from :meth:`restore_target`) now hold the restored array."""
        ...

    def sync_to_host(self, host_state: HostState | None) -> None:
        """Copy the state into ``host_state``'s slabs where it lives elsewhere (a full checkpoint)."""
        ...

    def flush(self) -> None:
        """Wait for the store's own background I/O."""
        ...


class HostSlabs:
    """State in the host slabs of ``host_state``: updated, read and restored in place."""

    def __init__(self, host_state: HostState) -> None:
        self.host_state = host_state

    def acquire(self, unit: Unit) -> dict[str, torch.Tensor]:
        return self.host_state.views(unit)

    def release(self, unit: Unit, read_ahead: ReadAhead) -> None:
        pass  # the slabs are where the state stays

    def read(self, unit: Unit, name: str) -> torch.Tensor:
        return self.host_state.views(unit)[name]

    def restore_target(self, unit: Unit, name: str) -> torch.Tensor:
        return self.read(unit, name)

    def restored(self, unit: Unit, name: str, values: torch.Tensor) -> None:
        pass  # written in place

    def sync_to_host(self, host_state: HostState | None) -> None:
        pass

    def flush(self) -> None:
        pass


class TierStore:
    """State of ``units`` (model order) on ``offloaded``'s tier; state loaded into ``host_state``'s slabs
    before the engine started is written to the tier first."""

    def __init__(self, units: Sequence[Unit], offloaded: OffloadedState, host_state: HostState) -> None:
        self.offloaded = offloaded
        order = [unit.name for unit in units]
        self._next = {"backward": dict(itertools.pairwise(reversed(order))), "forward": dict(itertools.pairwise(order))}
        for name in order:
            if host_state.valid[name]:
                offloaded.load_from(name, host_state.views(name))

    def acquire(self, unit: Unit) -> dict[str, torch.Tensor]:
        return self.offloaded.acquire(unit.name)

    def release(self, unit: Unit, read_ahead: ReadAhead) -> None:
        """Write the unit's state back and read ahead the next one's (Note [Staging reuse ordering])."""
        self.offloaded.release(unit.name)
        following = self._next[read_ahead].get(unit.name) if read_ahead is not None else None
        if following is not None:
            self.offloaded.prefetch(following)

    def read(self, unit: Unit, name: str) -> torch.Tensor:
        staged = self.offloaded.staged(unit.name, name)
        self.offloaded.read(unit.name, name, staged)
        return staged

    def restore_target(self, unit: Unit, name: str) -> torch.Tensor:
        return self.offloaded.staged(unit.name, name)  # filled, then written to the tier

    def restored(self, unit: Unit, name: str, values: torch.Tensor) -> None:
        self.offloaded.load_state(unit.name, name, values)

    def sync_to_host(self, host_state: HostState | None) -> None:
        if host_state is not None:
            for name in self.offloaded.units:
                self.offloaded.copy_to(name, host_state.views(name))

    def flush(self) -> None:
        self.offloaded.flush()
