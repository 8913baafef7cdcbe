"""Where every unit of one run lives and is updated, and so which buffers exist: one frozen value.

A run's layout used to be decided three times: by the planner (which re-derived the engine's rules), by
the run's setup and by :class:`~.unit_pipelines.UnitPipelines`. Each copy drifted from the others, so the
plan a user read was not the run they got. :class:`RunLayout` is built once from the
:class:`~.config.EngineConfig` (which names the resident, GPU-streamed and NVMe-backed units) and the
units' sizes; the engine walks it to build its pipelines, and the planner prices
:meth:`RunLayout.host_buffers` and :meth:`RunLayout.device_buffers`, each buffer sized by the class that
allocates it. A rule about placement lives here and nowhere else.

The roles of a unit (a unit has exactly one updater):

- **resident**: master and optimizer state on the device; the window never slides it.
- **streamed**: updated on the device as it streams through it; master and state stay in host RAM and
  cross PCIe with the unit, its gradient never does.
- **host-optimized**: updated by the host optimizer; its gradient crosses PCIe. Its state lives in the
  host slabs, or on the state tier when it is one of the config's ``offloaded_units``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slide_core.collectives import shard_span
from slide_core.optim.state_formats import StateArray
from slide_core.unit import SlideModel

from .config import EngineConfig
from .grad_transfer import GradTransfer
from .host_state import HostState
from .norms import UnitNorms
from .slots import SlotWindow
from .state_offload import OffloadedState

__all__ = ["RunLayout"]


@dataclass(frozen=True)
class RunLayout:
    """One run's placement of every unit, from its engine config and its units' sizes. The roles are
    computed once each (cached): the layout is asked for them per unit while buffers are priced.

    ``unit_numels``: every unit's name and padded element count (``unit.layout.numel``, what the engine
    allocates), in forward order: the embedding first, the blocks, the head last. ``tied``: the head
    borrows the embedding's matrix, so the embedding gets two gradient contributions every micro-batch.
    """

    config: EngineConfig
    unit_numels: tuple[tuple[str, int], ...]
    tied: bool = False

    def __post_init__(self) -> None:
        names = [name for name, _ in self.unit_numels]
        if len(names) < 2:
            raise ValueError(f"a model has at least an embedding and a head unit, got {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"unit names must be unique, got {names}")
        known = set(names)
        for what in ("resident_units", "streamed_units", "streamable_units", "offloaded_units"):
            unknown = sorted(set(getattr(self.config, what)) - known)
            if unknown:
                raise ValueError(f"EngineConfig.{what} names units the model does not have: {', '.join(unknown)}")
        both = sorted(set(self.config.offloaded_units) & set(self.config.resident_units))
        if both:
            raise ValueError(f"offloaded_units and resident_units must not share units, both name {', '.join(both)}")

    @classmethod
    def of(cls, model: SlideModel, config: EngineConfig) -> RunLayout:
        """The layout of ``model``'s units under ``config``."""
        numels = tuple((unit.name, unit.layout.numel) for unit in model.units)
        return cls(config, numels, tied=bool(model.head.borrowed))

    # -- the roles ------------------------------------------------------------------------------------------
    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """Every unit, in forward order."""
        return tuple(name for name, _ in self.unit_numels)

    @functools.cached_property
    def numel(self) -> Mapping[str, int]:
        return dict(self.unit_numels)

    @property
    def embedding(self) -> str:
        return self.unit_numels[0][0]

    @property
    def head(self) -> str:
        return self.unit_numels[-1][0]

    @functools.cached_property
    def blocks(self) -> tuple[str, ...]:
        return self.names[1:-1]

    @functools.cached_property
    def resident(self) -> frozenset[str]:
        return frozenset(self.config.resident_units)

    @functools.cached_property
    def streamed(self) -> frozenset[str]:
        return frozenset(self.config.streamed_units)

    @functools.cached_property
    def streamable(self) -> frozenset[str]:
        """Units the streamed path is built for: the streamed ones and those a run may move to it between
        steps (``EngineConfig.streamable_units``); what its staging is sized for."""
        return self.streamed | frozenset(self.config.streamable_units)

    @functools.cached_property
    def offloaded(self) -> frozenset[str]:
        """Host-optimized units whose optimizer state lives on the state tier."""
        return frozenset(self.config.offloaded_units)

    @functools.cached_property
    def sliding(self) -> tuple[str, ...]:
        """Units the window slides through the device: every one but the resident ones. Their host master
        crosses PCIe every step, and each is either streamed or host-optimized."""
        return tuple(name for name in self.names if name not in self.resident)

    @functools.cached_property
    def host_optimized(self) -> tuple[str, ...]:
        """Units the host optimizer updates (their gradient crosses PCIe)."""
        return tuple(name for name in self.sliding if name not in self.streamed)

    @functools.cached_property
    def host_steps(self) -> bool:
        """Whether the host optimizer may step a range in this run: a host-optimized unit's, a streamed one's
        in a run that re-places units between steps (``streamable_units``: a streamed unit may move to the
        host), or a streamed one's when a step clips (its correction and the next step's update run on the
        host). Without any, the engine reserves no host scratch and the plan prices none: a run whose every
        sliding unit is GPU-streamed for good holds none."""
        replaces = bool(self.config.streamable_units)
        return bool(self.host_optimized or replaces or (self.streamed and self.config.max_grad_norm > 0))

    @functools.cached_property
    def state_in_host_slabs(self) -> tuple[str, ...]:
        """Units whose optimizer state the host slabs hold: every sliding unit but those on the tier
        (a streamed unit's state travels from the slabs to the device and back)."""
        return tuple(name for name in self.sliding if name not in self.offloaded)

    def accumulating(self, micro_batches: int) -> tuple[str, ...]:
        """Sliding units that get an fp32 host accumulator: those with more than one gradient contribution
        per step (every one with several micro-batches; the embedding when the head borrows it). A
        resident unit accumulates on the device."""
        if micro_batches > 1:
            return self.sliding
        return tuple(name for name in self.sliding if name == self.embedding and self.tied)

    # -- the buffers, each sized by its owner ---------------------------------------------------------------
    def host_buffers(
        self, state_arrays: Sequence[StateArray], micro_batches: int, world_size: int = 1
    ) -> dict[str, int]:
        """Host bytes of the buffers whose size the layout alone decides, by their owners' reports:
        the optimizer state the host slabs hold (``optimizer_state``), the gradient accumulators
        (``grad_accumulators``), the pinned gradient ring or clipping store (``grad_ring``), the per-unit
        norms (``grad_norms``) and the staging in front of the state tier (``state_tier_staging``).

        With ``world_size`` data-parallel ranks, those of the rank that holds the most (rank 0, whose
        shards are the longest: ``shard_span``): a rank touches only its shards of the state slabs, sums
        only its shards and streams only its shards through the ring or the store (Note [Sharded master]
        in host_pipeline.py); the norms and the tier's staging, a whole unit long, are as in one process."""
        numel = {name: _longest_shard(n, world_size) for name, n in self.numel.items()}
        offloaded = [self.numel[name] for name in self.names if name in self.offloaded]
        return {
            "optimizer_state": HostState.state_bytes(state_arrays, [numel[n] for n in self.state_in_host_slabs]),
            "grad_accumulators": HostState.accumulator_bytes([numel[n] for n in self.accumulating(micro_batches)]),
            "grad_ring": GradTransfer.host_bytes(
                self.config,
                [numel[name] for name in self.host_optimized],
                [numel[name] for name in self.sliding if name in self.streamed],
            ),
            "grad_norms": UnitNorms.host_bytes_for(len(numel)) if UnitNorms.wanted(self.config) else 0,
            "state_tier_staging": OffloadedState.staging_bytes(state_arrays, max(offloaded)) if offloaded else 0,
        }

    def device_buffers(self) -> dict[str, int]:
        """Device bytes of the window's slots and the per-unit norms, by their owners' reports: block slots
        as large as the largest sliding block, and one slot each for a sliding embedding and head."""
        numel, d = self.numel, self.config.compute_dtype.itemsize
        blocks = [numel[name] for name in self.blocks if name not in self.resident]
        slots = SlotWindow.block_slot_count(blocks, self.config.block_slots)

        def edge_slot(name: str) -> int:
            return 0 if name in self.resident else SlotWindow.slot_bytes(numel[name], d)

        return {
            "block_slots": slots * SlotWindow.slot_bytes(max(blocks, default=0), d),
            "embedding_slot": edge_slot(self.embedding),
            "head_slot": edge_slot(self.head),
            "grad_norms": UnitNorms.device_bytes_for(len(numel)) if UnitNorms.wanted(self.config) else 0,
        }


def _longest_shard(numel: int, world_size: int) -> int:
    """Elements of the longest shard of a unit of ``numel`` over ``world_size`` ranks (rank 0's)."""
    lo, hi = shard_span(numel, 0, world_size)
    return hi - lo
