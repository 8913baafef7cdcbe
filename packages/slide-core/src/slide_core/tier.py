"""The Tier interface: a place bytes live (pinned RAM, an NVMe file, GPU-direct storage).

A tier stores flat tensors under string keys. ``put`` and ``get`` return futures so the engine can overlap
I/O with compute; ``result()`` on a future re-raises the worker's exception in the caller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from slide_core._lifecycle import Lifecycle

if TYPE_CHECKING:
    from slide_core.device import Device

__all__ = ["Tier", "TierError", "TierRequest"]


class TierError(RuntimeError):
    """An I/O failure that names the tier, the path or key, and the bytes involved."""


@dataclass(frozen=True)
class TierRequest:
    """What a run offers a tier it builds by name (``--offload-optimizer NAME``): see :meth:`Tier.for_run`.

    ``directory`` is the run's scratch directory on fast storage (``--nvme-dir``), or None when the user
    gave none; ``device`` is the run's open device (for page-locked slabs); ``capacity_bytes`` is an upper
    bound on the bytes the run will store at once.
    """

    directory: Path | None = None
    device: Device | None = None
    capacity_bytes: int | None = None


class Tier(Lifecycle, ABC):
    """Key-value storage for flat tensors with asynchronous put/get.

    Tiers are created closed; ``open()`` (or ``with tier:``) creates files, threads and buffers, and
    ``close()`` drains in-flight requests, releases everything and is safe to call twice.
    """

    name: str = "abstract"
    moves_device_memory: bool = False
    """True when ``put`` and ``get`` take device tensors and move their bytes to and from storage without
    the caller staging them in host memory (GPUDirect Storage). The caller must still have finished
    producing a tensor before ``put``, and must not read ``out`` before ``get``'s future is done."""

    on_disk: bool = False
    """True when the tier keeps its bytes in files under :attr:`TierRequest.directory`: a run then needs
    ``--nvme-dir``, and plans the bytes as disk, not host RAM."""

    @classmethod
    def doctor_facts(cls) -> dict[str, str]:
        """Lines ``slide doctor`` prints about this tier plugin on this machine (whether its hardware path
        is usable, and why). Probes only; never opens the tier. The default says nothing."""
        return {}

    @classmethod
    def for_run(cls, request: TierRequest) -> Tier:
        """A closed instance built from what a run offers; how a tier chosen by name gets its arguments.

        Each tier says which parts of ``request`` it uses and raises ``ValueError`` (one line) when one it
        needs is missing. A tier without this method can be used from Python, not selected by name.
        """
        raise TypeError(f"{cls.__name__} cannot be built by name: it has no for_run(TierRequest) classmethod")

    @classmethod
    def host_bytes_for(cls, request: TierRequest) -> int:
        """The host RAM an instance :meth:`for_run` builds from ``request`` holds once open (what its
        :meth:`host_bytes` will say), before any key is stored: the planner prices it with the run's other
        host buffers. The default: nothing."""
        return 0

    def host_bytes(self) -> int:
        """Host RAM this tier holds now in allocations of its own (a slab, bounce buffers, the keys of a
        tier in memory), by their storages' bytes: what the engine's allocation ledger counts for the tier.
        The default: nothing."""
        return 0

    @abstractmethod
    def put(self, key: str, tensor: torch.Tensor) -> Future[None]:
        """Store a copy of ``tensor`` under ``key``. The caller must not modify ``tensor`` until done."""

    @abstractmethod
    def get(self, key: str, out: torch.Tensor) -> Future[torch.Tensor]:
        """Read ``key`` into ``out`` (same numel and dtype as stored) and return ``out``."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Forget ``key`` and release its space."""

    @abstractmethod
    def capacity_bytes(self) -> int | None:
        """Bytes this tier can still hold, or None when unknown or unbounded."""
