"""Data parallel across processes: the process groups of one rank, made from torchrun's environment.

One process per GPU (``torchrun --nproc-per-node N ...``). Every rank slides the whole model through its
own device; the engine shards each unit's flat parameter range across the ranks
(:func:`~slide_core.collectives.shard_span`), and its unit pipelines move gradients and parameters
between the ranks through the collectives here. docs/distributed.md says what each rank holds.

:class:`ProcessGroupContext` owns the process groups of one run and implements
:class:`~slide_core.collectives.Collectives`: it creates the groups in ``__enter__`` and destroys them in
``__exit__``. torch.distributed keeps one default group per process, so one context can be open per
process at a time. A process started without a launcher (no torchrun variables in the environment) is a
world of one: :meth:`ProcessGroupContext.from_env` then returns a
:class:`~slide_core.collectives.SingleProcess`, which opens nothing, so callers need no branch. A process
that torchrun started alone (``--nproc-per-node 1``) does open its groups and runs every collective with
one shard per unit: one GPU then runs the collectives (NCCL on CUDA) that N GPUs run, which is how that
path is checked on a machine with one GPU (Note [One rank under torchrun]).

Note [One rank under torchrun]).

Note [One rank under torchrun]: at world size 1 every reduce-scatter and all-gather moves a shard that is the
whole unit onto itself, so the losses equal the single-process path's (tested with gloo in
tests/hf/test_data_parallel.py), and the checkpoints are the data-parallel layout (a manifest and one rank
folder), which resumes on any number of processes.

Note [One group per issuing thread]: every rank must issue the collectives of one group in the same
order. The engine issues them from two threads: the main thread (the gradients' reduce-scatter after each
backward, the step's sums of loss, token counts and norms, the masters' gather at a drain) and the h2d
thread (each load's all-gather). Each thread's order is the schedule's, the same on every rank, but the
interleaving of the two is not, so each thread has its own group: ``main`` (device tensors: also the
all-gather of a device-resident unit after its update) and ``host`` (host tensors, gloo) for the main
thread, ``loads`` for the h2d thread. Tested by every case of
tests/core/test_distributed.py (prefetching loads overlap the backward's reduce-scatters there).
With gloo each group progresses on its own. With NCCL the two device groups are two communicators whose
kernels may run at once on one GPU; NCCL documents that as safe only when every rank launches them in
the same order, which two threads do not promise. Their kernels take a few SMs each and can be resident
together, so they should both progress, but this has not run on several GPUs (docs/distributed.md); a
hang there would end at ``timeout_s`` with a :class:`CollectiveError`, not silently.

Note [Waits on one rank's work]: some waits are not for a collective computation but for work one rank
does alone or every rank does at its own pace, on disks and file systems: rank 0 preparing the data,
every rank writing its checkpoint shards or reading the weights. Those can differ by minutes between
ranks on a large model, which the collectives' ``timeout_s`` (a minute, to notice a hang soon) would turn
into a failed run, a checkpoint included. So :meth:`ProcessGroupContext.barrier` with ``slow=True`` goes
through a gloo group of its own whose timeout is ``phase_timeout_s`` (hours). A rank that dies meanwhile
still ends the wait at once: its connections close (gloo), and torchrun stops the other ranks.

Note [Collective failures]: a collective that fails (a peer closed its connections because it died, or
nothing came within ``timeout_s``) raises :class:`CollectiveError` naming this rank and the collective,
so no rank waits forever for one that is gone; the engine's worker threads carry it to the main thread
(Note [Worker failures] in engine/workers.py). Tested by ``test_a_killed_rank_stops_the_others``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from slide_core.collectives import SingleProcess, shard_span
from slide_core.engine.workers import EngineError

if TYPE_CHECKING:
    from slide_core.device import Device, Event, StreamRole

__all__ = ["DEFAULT_PHASE_TIMEOUT_S", "DEFAULT_TIMEOUT_S", "CollectiveError", "ProcessGroupContext", "shard_span"]

DEFAULT_TIMEOUT_S = 60.0
"""How long one collective may wait for the other ranks before it fails (Note [Collective failures])."""
DEFAULT_PHASE_TIMEOUT_S = 6 * 3600.0
"""How long a rank may wait for the others' work on disks (Note [Waits on one rank's work])."""

_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class CollectiveError(EngineError):
    """A collective failed on this rank: another rank stopped, or did not answer in time."""


class ProcessGroupContext:
    """The process groups of one data-parallel rank (see the module notes): the
    :class:`~slide_core.collectives.Collectives` of a run of several processes, or of one that torchrun
    started.

    ``backend`` is ``"nccl"`` for CUDA devices and ``"gloo"`` for the CPU device; host-side sums always
    go through a gloo group. The rendezvous reads ``MASTER_ADDR`` and ``MASTER_PORT`` from the
    environment (``env://``), which is what torchrun provides (its agent then already hosts the store).
    """

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        *,
        backend: str = "gloo",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        phase_timeout_s: float = DEFAULT_PHASE_TIMEOUT_S,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {local_rank}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not phase_timeout_s >= timeout_s:
            raise ValueError(f"phase_timeout_s must be >= timeout_s ({timeout_s}), got {phase_timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.backend = backend
        self.timeout_s = timeout_s
        self.phase_timeout_s = phase_timeout_s
        self._groups: dict[str, Any] = {}
        self._open = False
        self._last_sum: Event | None = None  # the last gradient sum's event on the d2h stream

    @classmethod
    def from_env(
        cls,
        device_type: str = "cpu",
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        phase_timeout_s: float = DEFAULT_PHASE_TIMEOUT_S,
        environ: Mapping[str, str] | None = None,
    ) -> ProcessGroupContext | SingleProcess:
        """This process's place in the run, as torchrun describes it (``RANK``, ``WORLD_SIZE``,
        ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): a :class:`SingleProcess` when ``WORLD_SIZE`` is
        unset and no launcher started this process. ``device_type`` (``"cpu"`` or ``"cuda"``) picks the
        backend. Raises ValueError naming a missing or malformed variable."""
        env = os.environ if environ is None else environ
        world_size = _env_int(env, "WORLD_SIZE", default=1)
        launched = all(env.get(name) for name in _ENV_VARS)  # torchrun sets every one, also for one process
        if world_size == 1 and not launched:
            return SingleProcess()
        for name in _ENV_VARS:
            if not env.get(name):
                raise ValueError(f"WORLD_SIZE is {world_size} but {name} is not set; launch with torchrun")
        backend = "nccl" if device_type == "cuda" else "gloo"
        rank, local_rank = _env_int(env, "RANK"), _env_int(env, "LOCAL_RANK")
        return cls(
            rank,
            world_size,
            local_rank,
            backend=backend,
            timeout_s=timeout_s,
            phase_timeout_s=phase_timeout_s,
        )

    # -- lifecycle -------------------------------------------------------------------------------------
    is_distributed = True
    """Whether the ranks exchange through torch.distributed (:class:`SingleProcess` says False)."""

    @property
    def is_open(self) -> bool:
        return self._open

    def __enter__(self) -> ProcessGroupContext:
        self.open()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    @property
    def device_index(self) -> int:
        """This rank's GPU: its local rank among the GPUs the process sees, modulo their number, so that a
        rank shown only its own GPU (as some schedulers arrange with ``CUDA_VISIBLE_DEVICES``) takes that
        one. 0 with gloo. The device a rank computes on must be this one (the engine checks)."""
        count = torch.cuda.device_count() if self.backend == "nccl" else 0
        return self.local_rank % count if count else 0

    def open(self) -> None:
        """Join the other ranks and create the groups (Note [One group per issuing thread])."""
        if self._open:
            return
        if dist.is_initialized():
            raise RuntimeError("torch.distributed already has a process group in this process; open one context")
        timeout = datetime.timedelta(seconds=self.timeout_s)
        options: dict[str, Any] = {}
        if self.backend == "nccl":
            torch.cuda.set_device(self.device_index)
            options["device_id"] = torch.device("cuda", self.device_index)
        dist.init_process_group(
            self.backend, init_method="env://", rank=self.rank, world_size=self.world_size, timeout=timeout, **options
        )
        try:
            self._groups = {
                "main": dist.group.WORLD,
                "loads": dist.new_group(backend=self.backend, timeout=timeout),
                "host": dist.new_group(backend="gloo", timeout=timeout),
                "phases": dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.phase_timeout_s)),
            }
        except BaseException:
            dist.destroy_process_group()
            raise
        self._open = True

    def close(self) -> None:
        """Destroy every group. Idempotent."""
        if not self._open:
            return
        self._open = False
        self._groups = {}
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- shards ----------------------------------------------------------------------------------------
    def span(self, numel: int) -> tuple[int, int]:
        """This rank's shard of a flat range of ``numel`` elements (:func:`shard_span`)."""
        return shard_span(numel, self.rank, self.world_size)

    def spans(self, numel: int) -> list[tuple[int, int]]:
        """Every rank's shard, in rank order."""
        return [shard_span(numel, rank, self.world_size) for rank in range(self.world_size)]

    def check_device(self, device: Device) -> None:
        """Refuse, in one line, a device this rank's groups cannot run with."""
        kind = device.torch_device.type
        if self.backend == "nccl" and kind != "cuda":
            raise ValueError(f"the nccl process group needs a cuda device, got {kind}")
        if self.backend == "nccl" and device.torch_device.index != self.device_index:
            raise ValueError(
                f"rank {self.rank} computes on {device.torch_device}, but its process group uses "
                f"cuda:{self.device_index} (its local rank's GPU); build the device with index=group.device_index"
            )
        if self.backend == "gloo" and device.is_accelerator:
            raise ValueError(f"a {kind} device needs the nccl process group, got gloo")
        if not self.is_open:
            raise ValueError("open the process group first: `with ProcessGroupContext(...) as group:`")

    # -- collectives (each in place; ``what`` names it in errors) ---------------------------------------
    def reduce_scatter_(self, flat: torch.Tensor, what: str) -> None:
        """Main thread, device tensor: sum ``flat`` over the ranks into this rank's shard of it (the rest
        of ``flat`` is left undefined). On a GPU the sum is ordered after, and before, the current stream's
        work without blocking the host."""
        group = self._group("main")
        spans = self.spans(flat.numel())
        lo, hi = spans[self.rank]
        if all(b - a == hi - lo for a, b in spans):  # one flat call, in place (ranks' shards tile ``flat``)
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            self._run(what, lambda: reduce_scatter(flat[lo:hi], flat, group=group, async_op=True))
            return
        # Uneven shards: one reduce per rank onto its shard (what a list reduce-scatter of uneven pieces
        # would do underneath, spelled out so that it does not depend on the backend's support for it).
        for owner, (a, b) in enumerate(spans):
            if b > a:
                self._run(what, functools.partial(dist.reduce, flat[a:b], owner, group=group, async_op=True))

    @contextlib.contextmanager
    def sum_gradient(self, device: Device, flat: torch.Tensor, what: str) -> Iterator[StreamRole]:
        """Note [Sharded stream order]: the sum is ordered on the d2h stream after an event of the compute
        that wrote the gradient, and so is what the caller issues inside (the shard's norm, the event its
        d2h waits for): the compute stream never waits for a collective until :meth:`wait_gradient_sums`."""
        written = device.record_event("compute")
        with device.stream("d2h"):
            device.wait_event("d2h", written)
            self.reduce_scatter_(flat, what)
            yield "d2h"
            self._last_sum = device.record_event("d2h")

    def wait_gradient_sums(self, device: Device) -> None:
        """The compute stream waits for the last :meth:`sum_gradient` (before the step's one read)."""
        if self._last_sum is not None:
            device.wait_event("compute", self._last_sum)
            self._last_sum = None

    def all_gather_(self, flat: torch.Tensor, what: str) -> None:
        """h2d thread, device tensor: every rank's shard of ``flat`` into every rank's ``flat``, ordered
        on the current stream as :meth:`reduce_scatter_` is."""
        self._gather(self._group("loads"), flat, what)

    def all_gather_main_(self, flat: torch.Tensor, what: str) -> None:
        """Main thread, device tensor: as :meth:`all_gather_`, through the main thread's group (a
        device-resident unit's parameters after its update, engine/resident_pipeline.py)."""
        self._gather(self._group("main"), flat, what)

    def gather_to_root_(self, flat: torch.Tensor, what: str, *, host: bool) -> None:
        """Main thread: every rank's shard of ``flat`` into rank 0's ``flat`` (the others' ``flat`` keeps
        its own shard only), through the gloo group (``host``) or the main group: one send per rank to
        rank 0, which receives them in rank order. What a drain does when only rank 0 needs the whole
        master (an export), so the other ranks never hold it."""
        group = self._group("host" if host else "main")
        for source, (a, b) in enumerate(self.spans(flat.numel())):
            if source == 0 or b <= a:
                continue
            if self.rank == 0:
                self._run(what, functools.partial(dist.irecv, flat[a:b], source, group=group))
            elif self.rank == source:
                self._run(what, functools.partial(dist.isend, flat[a:b], 0, group=group))

    def all_gather_host_(self, flat: torch.Tensor, what: str) -> None:
        """Main thread, host tensor: as :meth:`all_gather_`, through the gloo group."""
        self._gather(self._group("host"), flat, what)

    def all_reduce_(self, tensor: torch.Tensor, what: str) -> None:
        """Main thread, device tensor: the sum over the ranks, in place."""
        group = self._group("main")
        self._run(what, lambda: dist.all_reduce(tensor, group=group, async_op=True))

    def all_reduce_host_(self, tensor: torch.Tensor, what: str) -> None:
        """Main thread, host tensor: the sum over the ranks, in place, through the gloo group."""
        group = self._group("host")
        self._run(what, lambda: dist.all_reduce(tensor, group=group, async_op=True))

    def sum_counts(self, counts: Sequence[int], what: str) -> list[int]:
        """Main thread: integer counts summed over the ranks, through the gloo group."""
        values = torch.tensor(counts, dtype=torch.int64)
        self.all_reduce_host_(values, what)
        return [int(value) for value in values.tolist()]

    def sum_values(
        self, values: MutableMapping[str, float], keys: Sequence[str], what: str, *, ready: Callable[[], None]
    ) -> None:
        """Main thread: ``values[key]`` of every key (NaN where absent) summed over the ranks in place, once
        ``ready()`` has returned, through the gloo group."""
        if not keys:
            return
        ready()
        summed = torch.tensor([values.get(key, math.nan) for key in keys], dtype=torch.float64)
        self.all_reduce_host_(summed, what)
        values.update(zip(keys, summed.tolist(), strict=True))

    def broadcast_object(self, value: Any, what: str) -> Any:
        """Main thread: rank 0's ``value`` (any picklable object) on every rank, through the gloo group, for
        a decision every rank must take alike (which units live on the device, for one)."""
        holder = [value]
        group = self._group("host")
        self._run(what, lambda: dist.broadcast_object_list(holder, src=0, group=group))
        return holder[0]

    def barrier(self, what: str, *, slow: bool = False) -> None:
        """Main thread: wait until every rank has come here (a sum of nothing through a gloo group, so it
        fails like any collective, Note [Collective failures]). ``slow``: the others may be minutes or hours
        behind, doing work on disks (Note [Waits on one rank's work]): wait up to ``phase_timeout_s``.
        """
        group = self._group("phases" if slow else "host")
        limit = self.phase_timeout_s if slow else self.timeout_s
        self._run(what, lambda: dist.all_reduce(torch.zeros(1), group=group, async_op=True), limit)

    def _gather(self, group: Any, flat: torch.Tensor, what: str) -> None:
        spans = self.spans(flat.numel())
        lo, hi = spans[self.rank]
        if all(b - a == hi - lo for a, b in spans):
            all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            self._run(what, lambda: all_gather(flat, flat[lo:hi], group=group, async_op=True))
            return
        # Uneven shards: gloo's all_gather takes equal sizes only, so each rank broadcasts its own shard
        # (every group spans all ranks, so a group rank is the global rank).
        for source, (a, b) in enumerate(spans):
            if b > a:
                self._run(what, functools.partial(dist.broadcast, flat[a:b], source, group=group, async_op=True))

    def _group(self, role: str) -> Any:
        if not self._open:
            raise RuntimeError("the process groups are not open (use `with ProcessGroupContext(...)`)")
        return self._groups[role]

    def _run(self, what: str, issue: Callable[[], Any], limit_s: float | None = None) -> None:
        """Issue one collective and wait for it: the host blocks on gloo; on NCCL the current stream waits
        (no host block). A failure becomes a :class:`CollectiveError` (Note [Collective failures]) that
        names ``limit_s`` (the group's timeout; ``timeout_s`` by default)."""
        try:
            work = issue()
            if work is not None:
                work.wait()
        except RuntimeError as exc:
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CollectiveError(
                f"rank {self.rank} of {self.world_size}: {what} failed ({cause}); another rank has probably "
                f"stopped (its own output says why) or did not answer within {limit_s or self.timeout_s:.0f} s"
            ) from exc

    def __repr__(self) -> str:
        return f"ProcessGroupContext(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"


def _env_int(env: Mapping[str, str], name: str, *, default: int | None = None) -> int:
    value = env.get(name)
    if not value:
        if default is None:
            raise ValueError(f"{name} is not set; launch with torchrun")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
