"""What the engine asks of the other ranks of a run, and the world of one process, where that is nothing.

One process is a world of size one (as in FSDP2): every unit pipeline works on this rank's shard
``[lo, hi)`` of each unit and moves the rest through a :class:`Collectives` object. With several ranks
that object is slide_core/distributed.py's :class:`~slide_core.distributed.ProcessGroupContext` (gloo or
NCCL); in one process it is :class:`SingleProcess`, whose shard of every unit is the whole unit and whose
collectives return at once. So the engine never asks whether there are other processes: it runs one
path, and the size-one case of it costs what a single-process engine costs.

Note [Collectives at world size one]: :class:`SingleProcess` issues no device work, copies nothing,
allocates nothing and never synchronizes: each sum or gather over one rank is the value itself, in place.
Its :meth:`~SingleProcess.sum_gradient` leaves the caller on the compute stream, so a host-updated unit's
gradient is written, normed and handed to the d2h stage in the order of a plain single-process run.
Tested by ``test_one_process_runs_the_pipelines_of_every_world_size`` (tests/core/test_collectives.py).

This module imports no ``torch.distributed``: the engine and everything of one process stay free of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from slide_core.device import Device, StreamRole

__all__ = ["Collectives", "SingleProcess", "shard_span"]


def shard_span(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous shard ``[lo, hi)`` of a flat range of ``numel`` elements: shards of
    ``ceil(numel / world_size)`` elements, the last ones shorter (empty when ``numel < world_size``)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    per_rank = -(-numel // world_size)
    lo = min(numel, rank * per_rank)
    return lo, min(numel, lo + per_rank)


class Collectives(Protocol):
    """This rank's place in the run, and the sums and gathers over the ranks the engine issues.

    Each collective works in place on a flat tensor; ``what`` names it in errors. The ``*_host_``
    variants take host tensors (through a gloo group), the others device tensors. Threads: every method
    runs on the main thread except :meth:`all_gather_`, which the h2d thread issues (Note [One group per
    issuing thread] in slide_core/distributed.py).
    """

    rank: int
    world_size: int

    def span(self, numel: int) -> tuple[int, int]:
        """This rank's shard ``[lo, hi)`` of a flat range of ``numel`` elements (:func:`shard_span`)."""
        ...

    def check_device(self, device: Device) -> None:
        """Refuse, in one line, a device these collectives cannot run on."""
        ...

    def reduce_scatter_(self, flat: torch.Tensor, what: str) -> None:
        """Sum ``flat`` over the ranks into this rank's shard of it (the rest is left undefined)."""
        ...

    def sum_gradient(
        self, device: Device, flat: torch.Tensor, what: str
    ) -> contextlib.AbstractContextManager[StreamRole]:
        """Sum a gradient just written on the compute stream over the ranks into this rank's shard, and
        enter the stream the shard is read on from then (its norm, its d2h): yields that stream's role.
        :meth:`wait_gradient_sums` orders the compute stream after the last one."""
        ...

    def wait_gradient_sums(self, device: Device) -> None:
        """Make the compute stream wait for every :meth:`sum_gradient` issued so far."""
        ...

    def all_gather_(self, flat: torch.Tensor, what: str) -> None:
        """h2d thread: every rank's shard of ``flat`` into every rank's ``flat``."""
        ...

    def all_gather_main_(self, flat: torch.Tensor, what: str) -> None:
        """As :meth:`all_gather_`, issued by the main thread."""
        ...

    def all_gather_host_(self, flat: torch.Tensor, what: str) -> None:
        """As :meth:`all_gather_`, for a host tensor."""
        ...

    def gather_to_root_(self, flat: torch.Tensor, what: str, *, host: bool) -> None:
        """Every rank's shard of ``flat`` into rank 0's ``flat`` (the others keep their own shard only)."""
        ...

    def all_reduce_(self, tensor: torch.Tensor, what: str) -> None:
        """The sum over the ranks of a device tensor, in place."""
        ...

    def all_reduce_host_(self, tensor: torch.Tensor, what: str) -> None:
        """The sum over the ranks of a host tensor, in place."""
        ...

    def sum_counts(self, counts: Sequence[int], what: str) -> list[int]:
        """Integer counts summed over the ranks."""
        ...

    def sum_values(
        self, values: MutableMapping[str, float], keys: Sequence[str], what: str, *, ready: Callable[[], None]
    ) -> None:
        """Sum ``values[key]`` for every key of ``keys`` (NaN where absent) over the ranks, in place, once
        ``ready()`` (which waits until they are complete) has returned; neither the wait nor the sum
        happens where there is nothing to sum with."""
        ...

    def broadcast_object(self, value: Any, what: str) -> Any:
        """Rank 0's ``value`` (picklable) on every rank."""
        ...

    def barrier(self, what: str, *, slow: bool = False) -> None:
        """Wait until every rank has come here (``slow``: the others may be hours behind, on disks)."""
        ...


class SingleProcess:
    """The collectives of a world of one process: every shard is the whole unit and every collective
    returns at once, having done nothing (Note [Collectives at world size one]).

    It also has :class:`~slide_core.distributed.ProcessGroupContext`'s lifecycle and identity
    (``open``/``close``, a context manager, ``backend``, ``device_index``), so a caller that opens the
    run's collectives needs no branch for one process."""

    rank = 0
    world_size = 1
    local_rank = 0
    backend = "gloo"
    device_index = 0
    is_distributed = False
    """Whether the ranks exchange through torch.distributed: never here."""

    def __init__(self) -> None:
        self._open = False
        self._on_compute: contextlib.nullcontext[StreamRole] = contextlib.nullcontext("compute")

    # -- lifecycle -------------------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._open

    def open(self) -> None:
        self._open = True

    def close(self) -> None:
        self._open = False

    def __enter__(self) -> SingleProcess:
        self.open()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    # -- shards ----------------------------------------------------------------------------------------
    def span(self, numel: int) -> tuple[int, int]:
        return 0, numel

    def check_device(self, device: Device) -> None:
        pass  # one process runs on any device

    # -- collectives: the value itself, in place -------------------------------------------------------
    def reduce_scatter_(self, flat: torch.Tensor, what: str) -> None:
        pass

    def sum_gradient(
        self, device: Device, flat: torch.Tensor, what: str
    ) -> contextlib.AbstractContextManager[StreamRole]:
        return self._on_compute  # nothing to sum: stay on the compute stream, issue nothing

    def wait_gradient_sums(self, device: Device) -> None:
        pass

    def all_gather_(self, flat: torch.Tensor, what: str) -> None:
        pass

    def all_gather_main_(self, flat: torch.Tensor, what: str) -> None:
        pass

    def all_gather_host_(self, flat: torch.Tensor, what: str) -> None:
        pass

    def gather_to_root_(self, flat: torch.Tensor, what: str, *, host: bool) -> None:
        pass

    def all_reduce_(self, tensor: torch.Tensor, what: str) -> None:
        pass

    def all_reduce_host_(self, tensor: torch.Tensor, what: str) -> None:
        pass

    def sum_counts(self, counts: Sequence[int], what: str) -> list[int]:
        return list(counts)

    def sum_values(
        self, values: MutableMapping[str, float], keys: Sequence[str], what: str, *, ready: Callable[[], None]
    ) -> None:
        pass

    def broadcast_object(self, value: Any, what: str) -> Any:
        return value

    def barrier(self, what: str, *, slow: bool = False) -> None:
        pass

    def __repr__(self) -> str:
        return "SingleProcess()"
