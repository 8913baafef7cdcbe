"""Pinned host memory that carries gradients from the device to the optimizer thread.

Two layouts, chosen by ``EngineConfig.max_grad_norm``:

- :class:`GradRing` (clipping off): a fixed ring bounds the host memory gradients use in flight
  (``slots x chunk`` elements, whatever the model size) and gives back-pressure: the transfer thread waits
  for a free chunk, never allocates one. A chunk is reused as soon as the optimizer has applied it.
- :class:`GradStore` (clipping on): every host-updated unit's gradient of the step, each at its own offset.
  Clipping is decided only once the whole step's gradient norm is known, after the speculative updates
  (docs/design/engine.md, "Clipping"); correcting them needs the very gradient each one applied, so the bytes must outlive
  the update. The device-to-host copy lands straight in the unit's range, so keeping the gradient costs
  no extra host copy, only memory: one compute-dtype element per host-updated parameter (2 bytes/param in
  bf16; 16 GB for an 8B model), instead of the ring's ``slots x chunk``. A data-parallel rank streams and
  updates only its shard of each unit (host_pipeline.py), so its store holds only its shards: the
  ranks of one host together keep the step's gradient once, not once per rank.

Note [Grad store reuse]: a unit's store range is written once per gradient contribution. Within a step
(gradient accumulation, a tied head's share of the embedding gradient) the transfer of contribution k+1
waits until the optimizer thread has consumed contribution k (folded it into the fp32 accumulator).
Across steps no wait is needed: a unit's first transfer of step n+1 follows its backward, which follows
its load, which waits for its step-n ``updated`` future, resolved only after the step-n correction that
reads the range (Note [Clip rollback ordering] in docs/design/engine.md). Tested by the accumulated and tied cases of
``test_clipping_matches_clip_grad_norm``.
"""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence

import torch

from slide_core.allocation_ledger import AllocationLedger
from slide_core.device import Device
from slide_core.unit import Unit

__all__ = ["GradRing", "GradStore"]


class GradRing:
    """``slots`` pinned chunks of ``chunk_numel`` in one slab (see module notes); ``ledger``: the engine's,
    which counts the slab."""

    def __init__(
        self,
        device: Device,
        slots: int,
        chunk_numel: int,
        dtype: torch.dtype,
        *,
        ledger: AllocationLedger | None = None,
    ) -> None:
        self.chunk_numel = chunk_numel
        slab = device.alloc_pinned(self.slab_numel(slots, chunk_numel), dtype)
        self._slab = (ledger or AllocationLedger()).record(self, "grad_ring", slab)
        self.chunks = [self._slab[i * chunk_numel : (i + 1) * chunk_numel] for i in range(slots)]
        self.free: queue.Queue[int] = queue.Queue()
        for index in range(slots):
            self.free.put(index)

    @staticmethod
    def slab_numel(slots: int, chunk_numel: int) -> int:
        """Elements of the ring's one pinned slab: ``slots`` chunks of ``chunk_numel``."""
        return slots * chunk_numel

    @staticmethod
    def slab_bytes(slots: int, chunk_numel: int, dtype_bytes: int) -> int:
        """Pinned host bytes of a ring of ``slots`` chunks (what the planner prices)."""
        return GradRing.slab_numel(slots, chunk_numel) * dtype_bytes

    def release(self, index: int) -> None:
        self.free.put(index)

    @property
    def nbytes(self) -> int:
        return self._slab.numel() * self._slab.element_size()


class GradStore:
    """One pinned compute-dtype slab holding the gradient of every unit in ``units`` (see module notes).

    ``spans``: the range ``[lo, hi)`` of each unit's gradient this process streams (a data-parallel rank's
    shard); the whole unit where absent. Only those elements are stored. ``ledger``: the engine's, which
    counts the slab.
    """

    def __init__(
        self,
        device: Device,
        units: Sequence[Unit],
        dtype: torch.dtype,
        spans: Mapping[str, tuple[int, int]] | None = None,
        *,
        ledger: AllocationLedger | None = None,
    ) -> None:
        self._ranges: dict[str, tuple[int, int, int]] = {}
        total = 0
        for unit in units:
            lo, hi = (spans or {}).get(unit.name, (0, unit.layout.numel))
            self._ranges[unit.name] = (total, lo, hi)
            total += hi - lo
        slab = device.alloc_pinned(self.slab_numel([hi - lo for _, lo, hi in self._ranges.values()]), dtype)
        self._slab = (ledger or AllocationLedger()).record(self, "grad_ring", slab)

    @staticmethod
    def slab_numel(span_numels: Sequence[int]) -> int:
        """Elements of the store's one pinned slab: every stored span, back to back (at least one)."""
        return max(sum(span_numels), 1)

    @staticmethod
    def slab_bytes(span_numels: Sequence[int], dtype_bytes: int) -> int:
        """Pinned host bytes of a store of spans of ``span_numels`` elements (what the planner prices)."""
        return GradStore.slab_numel(span_numels) * dtype_bytes

    def range(self, unit: Unit | str, lo: int, hi: int) -> torch.Tensor:
        """Where elements ``[lo, hi)`` of the unit's gradient (positions in its layout, alignment padding
        included) are kept; they must lie in its span."""
        start, span_lo, span_hi = self._ranges[unit if isinstance(unit, str) else unit.name]
        if not span_lo <= lo <= hi <= span_hi:
            raise IndexError(f"[{lo}, {hi}) is outside the stored span [{span_lo}, {span_hi})")
        return self._slab[start + lo - span_lo : start + hi - span_lo]

    def __contains__(self, name: object) -> bool:
        return name in self._ranges

    @property
    def nbytes(self) -> int:
        return self._slab.numel() * self._slab.element_size()
