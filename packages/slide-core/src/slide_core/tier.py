"""The Tier interface: a place bytes live (pinned RAM, an NVMe file, GPU-direct storage).

A tier stores flat tensors under string keys. ``put`` and ``get`` return futures so the engine can overlap
I/O with compute; ``result()`` on a future re-raises the worker's exception in the caller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

import torch

from slide_core._lifecycle import Lifecycle

__all__ = ["Tier", "TierError"]


class TierError(RuntimeError):
    """An I/O failure that names the tier, the path or key, and the bytes involved."""


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
