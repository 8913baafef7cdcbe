"""What one engine holds in host RAM for its buffers, counted where each buffer is allocated.

Why: the planner prices every host buffer of a run by its owner's rule (slide_hf/planner/memory.py, from
:class:`~slide_core.engine.layout.RunLayout`), before anything is allocated. This ledger counts the same
buffers from the other side: at the calls that allocate them (the device's pinned slabs, the host tensors
of the state slabs and accumulators, the stashes and staging sets), by the bytes of each allocation's
storage, not by the layout's arithmetic. tests/hf/test_plan_is_the_run.py holds the two equal, buffer by
buffer, for the runs `slide train` makes.

Each record names the buffer with the plan's key for it (``master_fp32``, ``optimizer_state``,
``grad_accumulators``, ``grad_ring``, ``activation_stash``, ``optimizer_scratch``, ``grad_norms``,
``nvme_staging``) and the class that allocated it. A record lives as long as its storage: a finalizer
takes it off when torch frees the memory, so a buffer dropped or replaced is not counted twice.

Two more kinds of bytes complete a buffer:

- **untouched**: ranges of an allocation the engine never writes (a data-parallel rank's view of the other
  ranks' shards, the state of units kept elsewhere, the host master of device-resident units, whose pages
  are given back). Pageable pages never written cost no memory, and the plan prices what is touched, so
  a buffer counts its allocations less these ranges, each measured on the engine's own tensors;
- **held**: bytes an object the engine borrows allocates on its own, read from it when the ledger is read
  (the optimizer's scratch, a tier's own buffers): a plugin's allocations cannot be routed through here.

Recording happens where buffers are allocated: at setup, and on first use for the accumulators and the
optimizer's scratch. A step adds nothing; ``allocations`` counts every allocation recorded, so a buffer
allocated again every step shows there.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

__all__ = ["AllocationLedger", "HostAllocations", "held_host_bytes"]


@dataclass(frozen=True)
class HostAllocations:
    """A reading of an :class:`AllocationLedger`: host bytes by buffer (the plan's keys), allocated and
    still alive, less the ranges the engine never writes, plus what its borrowed objects hold.

    ``owners``: each buffer's bytes by the class that allocated (or holds) them, for saying which one
    drifted. ``allocations``: how many allocations each buffer has had since the engine was built."""

    buffers: Mapping[str, int]
    owners: Mapping[str, Mapping[str, int]]
    allocations: Mapping[str, int]
    untouched: Mapping[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.buffers.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every mapping as a plain dict."""
        return {
            "buffers": dict(self.buffers),
            "owners": {buffer: dict(owners) for buffer, owners in self.owners.items()},
            "allocations": dict(self.allocations),
            "untouched": dict(self.untouched),
            "total_bytes": self.total_bytes,
        }


@dataclass
class _Record:
    buffer: str
    owner: str
    nbytes: int
    untouched: int = 0


class AllocationLedger:
    """Host allocations of one engine, by buffer and owner (see the module docstring). Thread-safe: the
    optimizer thread allocates accumulators and scratch on first use, and a finalizer may run anywhere."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._live: dict[int, _Record] = {}  # by the id of the storage, whose Python object torch keeps alive
        self._count: Counter[str] = Counter()
        self._held: list[tuple[str, str, Callable[[], int]]] = []

    def record(self, owner: object, buffer: str, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor``'s storage (a fresh host allocation ``owner`` made for ``buffer``) for as long as
        it lives; returns ``tensor``, so an allocation reads ``x = ledger.record(self, key, alloc(...))``.
        A tensor off the host counts nothing: the ledger is of host memory."""
        if tensor.device.type != "cpu":
            return tensor
        storage = tensor.untyped_storage()
        key = id(storage)
        with self._lock:
            self._count[buffer] += 1
            if key in self._live:  # one allocation recorded twice (a view of it): counted once
                return tensor
            self._live[key] = _Record(buffer, type(owner).__name__, storage.nbytes())
        weakref.finalize(storage, self._freed, key)
        return tensor

    def leave_untouched(self, view: torch.Tensor, nbytes: int | None = None) -> None:
        """``view`` is a range of a recorded allocation that the engine never writes (``nbytes`` of it,
        all of it by default): those bytes cost no memory and are taken off the allocation's buffer. A
        view of an unrecorded tensor is ignored."""
        if nbytes is None:
            nbytes = view.numel() * view.element_size()
        if nbytes <= 0:
            return
        with self._lock:
            record = self._live.get(id(view.untyped_storage()))
            if record is not None:
                record.untouched = min(record.nbytes, record.untouched + nbytes)

    def hold(self, owner: object, buffer: str, held_bytes: Callable[[], int]) -> None:
        """Count, whenever the ledger is read, the host bytes ``owner`` holds for ``buffer`` in allocations
        of its own (``held_bytes()``): an optimizer's scratch, a tier's buffers."""
        with self._lock:
            self._held.append((buffer, type(owner).__name__, held_bytes))

    def reading(self) -> HostAllocations:
        """The ledger now, as a read-only value."""
        with self._lock:
            records = list(self._live.values())
            held = list(self._held)
            counts = dict(self._count)
        owners: dict[str, Counter[str]] = {}
        untouched: Counter[str] = Counter()
        for record in records:
            owners.setdefault(record.buffer, Counter())[record.owner] += record.nbytes - record.untouched
            untouched[record.buffer] += record.untouched
        for buffer, owner, held_bytes in held:
            owners.setdefault(buffer, Counter())[owner] += held_bytes()
        buffers = {buffer: sum(by_owner.values()) for buffer, by_owner in owners.items()}
        return HostAllocations(
            buffers=MappingProxyType(buffers),
            owners=MappingProxyType({b: MappingProxyType(dict(o)) for b, o in owners.items()}),
            allocations=MappingProxyType(counts),
            untouched=MappingProxyType(dict(untouched)),
        )

    def _freed(self, key: int) -> None:
        with self._lock:
            self._live.pop(key, None)


def held_host_bytes(root: object) -> int:
    """Host bytes of every host tensor and numpy array reachable from ``root``'s attributes (through
    dicts, lists, tuples and the attributes of objects of ``root``'s package or slide-core's), each storage
    once: what an object that allocates for itself holds now, read from the object rather than from a rule."""
    packages = {type(root).__module__.split(".")[0], __name__.split(".")[0]}
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack: list[Any] = [root]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if item.device.type == "cpu":
                storage = item.untyped_storage()
                storages[id(storage)] = storage.nbytes()
        elif isinstance(item, np.ndarray):
            while isinstance(item.base, np.ndarray):  # a view: its memory is the array it views
                item = item.base
            storages[id(item if item.base is None else item.base)] = item.nbytes
        elif isinstance(item, dict):
            stack.extend(list(item.values()))
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(list(item))
        elif (
            type(item).__module__.split(".")[0] in packages and hasattr(item, "__dict__") and not isinstance(item, type)
        ):
            stack.extend(list(vars(item).values()))
    return sum(storages.values())
