"""The simplest tier: ordinary host memory, synchronous copies.

It keeps slide-core usable on its own. slide-io adds a pinned slab tier and NVMe/GDS tiers.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TypeVar

import torch

from slide_core.tier import Tier, TierError, TierRequest

T = TypeVar("T")


def _done(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future


class HostRamTier(Tier):
    """Stores each key in its own host tensor."""

    name = "ram"

    def __init__(self) -> None:
        super().__init__()
        self._store: dict[str, torch.Tensor] = {}

    @classmethod
    def for_run(cls, request: TierRequest) -> HostRamTier:
        """Needs nothing from the run: it allocates each key as it arrives."""
        return cls()

    def put(self, key: str, tensor: torch.Tensor) -> Future[None]:
        held = self._store.get(key)
        if held is None or held.numel() != tensor.numel() or held.dtype != tensor.dtype:
            held = torch.empty(tensor.numel(), dtype=tensor.dtype)
            self._store[key] = held
        held.copy_(tensor.reshape(-1))
        return _done(None)

    def get(self, key: str, out: torch.Tensor) -> Future[torch.Tensor]:
        held = self._store.get(key)
        if held is None:
            raise TierError(f"ram tier has no key {key!r}")
        if held.numel() != out.numel() or held.dtype != out.dtype:
            raise TierError(
                f"ram tier key {key!r} holds {held.numel()} x {held.dtype}, asked for {out.numel()} x {out.dtype}"
            )
        out.reshape(-1).copy_(held)
        return _done(out)

    def delete(self, key: str) -> None:
        self._store.pop(key, None)

    def capacity_bytes(self) -> int | None:
        return None

    def host_bytes(self) -> int:
        """Every key's tensor: the tier keeps what it stores in host RAM."""
        return sum(held.untyped_storage().nbytes() for held in list(self._store.values()))

    def _close_resources(self) -> None:
        self._store.clear()
