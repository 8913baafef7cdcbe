"""The Tier interface: a place bytes live (pinned RAM, an NVMe file, GPU-direct storage).

A tier stores flat tensors under string keys. ``put`` and ``get`` return futures so the engine can overlap
I/O with compute; ``result()`` on a future re-raises the worker's exception in the caller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

import torch

__all__ = ["Tier", "TierError"]


class TierError(RuntimeError):
    """An I/O failure that names the tier, the path or key, and the bytes involved."""


class Tier(ABC):
    """Key-value storage for flat tensors with asynchronous put/get.

    Tiers are created closed; ``open()`` (or ``with tier:``) creates files, threads and buffers, and
    ``close()`` drains in-flight requests, releases everything and is safe to call twice.
    """

    name: str = "abstract"

    def __init__(self) -> None:
        self._open = False

    def open(self) -> Tier:
        if not self._open:
            self._open_resources()
            self._open = True
        return self

    def close(self) -> None:
        if self._open:
            self._open = False
            self._close_resources()

    def __enter__(self) -> Tier:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open_resources(self) -> None:  # noqa: B027 - optional hook
        pass

    def _close_resources(self) -> None:  # noqa: B027 - optional hook
        pass

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
