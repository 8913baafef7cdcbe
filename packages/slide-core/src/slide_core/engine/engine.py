"""The sliding-window training engine: the schedule of one optimizer step, read as one page.

:meth:`Engine.step` takes a list of micro-batches, each host tensors (B, S) int64: ``(input_ids, labels)``
or, for rows packed with several documents, ``(input_ids, labels, position_ids)`` (Note [Packed
micro-batches] in micro_batch.py), and walks each through forward, head and backward
(micro_batch_walk.py), each visit in a device slot the slot loader fills ahead of it (slot_loader.py).
Every gradient goes to its unit's pipeline (pipeline.py), which carries it to the unit's update: across
PCIe to the host optimizer thread (host_pipeline.py, with its state in RAM or on a tier, state_store.py)
or on the device (resident_pipeline.py), each on this rank's shard of the unit (shards.py). The step's
clip strategy (clip_strategy.py) decides what becomes of each final gradient and ends the step. The
engine itself holds the step, its sums over the ranks and the lifecycle. docs/design/engine.md draws the
whole pipeline (threads, streams, buffers and their owners) and holds the notes cited here without a file.

One process is a world of size one: the engine always runs with a
:class:`~slide_core.collectives.Collectives` object, :class:`~slide_core.collectives.SingleProcess` by
default, whose collectives do nothing (Note [Collectives at world size one]), or a data-parallel rank's
:class:`~slide_core.distributed.ProcessGroupContext`. Nothing here asks which.

:meth:`Engine.evaluate` runs a forward-only pass through the same window (evaluation.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slide_core.allocation_ledger import AllocationLedger, HostAllocations
from slide_core.collectives import Collectives, SingleProcess
from slide_core.device import Device
from slide_core.host_params import HostParameters
from slide_core.optimizer import Optimizer
from slide_core.tier import Tier
from slide_core.unit import SlideModel

from . import checkpointing
from .activations import ActivationStash, TierActivationStash
from .clip_strategy import ClipPolicy
from .config import EngineConfig
from .context import StepContext
from .evaluation import Evaluation
from .grad_transfer import GradTransfer
from .host_pipeline import HostPipeline
from .host_state import HostState
from .micro_batch import MicroBatchLike, split_micro_batch
from .micro_batch_walk import MicroBatchWalk
from .resident import ResidentUnits
from .run_checks import check_run
from .slot_loader import SlotLoader
from .slots import SlotWindow
from .state_offload import OffloadedState
from .state_source import StateSource
from .timeline import ComputeTimer, Timeline, UnitTimes
from .unit_pipelines import UnitPipelines
from .workers import EngineError, Workers

__all__ = ["Engine", "StepResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step measured. ``loss`` is the mean over every label token the step consumed,
    computed before the step's update.

    ``grad_norm`` is the global gradient 2-norm before clipping (Note [Gradient norm of every step]; None
    only with clipping off and ``EngineConfig.report_grad_norm`` False). ``skipped`` says the step's
    gradients were not finite and the step was taken back exactly; ``step`` is then the number the step
    would have had, and the next step reuses it (the Adam step counter did not advance).
    """

    step: int
    loss: float
    tokens: int
    loss_tokens: int
    lr: float
    wall_s: float
    grad_norm: float | None = None
    skipped: bool = False


class Engine(Evaluation):
    """Trains a :class:`SlideModel` whose fp32 master lives in ``host_params`` on ``device``.

    A context manager: entering allocates slots, buffers, pipelines and threads; leaving drains pending
    updates (when no exception is in flight), joins every thread and drops every buffer. Two engines can
    coexist.
    """

    # Built by __enter__, dropped by close():
    pipelines: UnitPipelines
    """Every unit's pipeline (and the buffers they share: norms, the gradient transfer)."""
    window: SlotWindow
    loader: SlotLoader
    """Fills the window's slots ahead of each visit (slot_loader.py)."""
    walk: MicroBatchWalk
    """One micro-batch's forward, head and backward (micro_batch_walk.py)."""
    stash: ActivationStash | TierActivationStash
    residents: ResidentUnits
    """The device-resident units' buffers (kept after close, like their device memory)."""
    host_pipeline: HostPipeline
    transfer: GradTransfer

    def __init__(
        self,
        model: SlideModel,
        device: Device,
        host_params: HostParameters,
        optimizer: Optimizer,
        config: EngineConfig | None = None,
        state_tier: Tier | None = None,
        activation_tier: Tier | None = None,
        process_group: Collectives | None = None,
    ) -> None:
        """``state_tier`` (an open :class:`Tier`) holds the Adam state of ``config.offloaded_units``;
        ``activation_tier`` (open), when given, holds the blocks' boundary activations instead of RAM.

        ``process_group``: the run's collectives (open). A data-parallel rank's
        :class:`~slide_core.distributed.ProcessGroupContext` makes this engine one rank of the run: each
        rank steps on its own part of every step's batch, and every unit's master and optimizer state is
        sharded across the ranks (docs/distributed.md). By default a :class:`SingleProcess`, a world of
        size one."""
        cfg = self.config = config or EngineConfig()
        collectives = self.collectives = process_group or SingleProcess()
        check_run(model, device, host_params, optimizer, cfg, collectives)
        self.model, self.device, self.host_params, self.optimizer = model, device, host_params, optimizer
        self.dtype = cfg.compute_dtype
        self.step_count = 0
        self.steps_before = 0
        """Adam steps taken before this run's first (a run started from another run's AdamW state); its
        own step is ``step_count - steps_before`` (``StepContext.run_step``)."""
        self.timeline = Timeline(cfg.record_timings)
        self.timer = ComputeTimer(device, self.timeline)  # compute-stream spans, shared with the pipelines
        self.clip_policy = ClipPolicy(cfg)
        ledger = self._ledger = _ledger_of(host_params, optimizer, state_tier, activation_tier)
        self._offloaded = OffloadedState.of_config(model, cfg, state_tier, optimizer.state_arrays, ledger=ledger)
        elsewhere = {*cfg.resident_units, *cfg.offloaded_units}
        self.host_state = HostState(model, host_params, optimizer.state_arrays, elsewhere, ledger=ledger)
        self.updated: dict[str, Future[None]] = {unit.name: _done() for unit in model.units}
        """Each unit's latest 'updated' future: what its next load waits for (Note [Update futures])."""
        self._activation_tier = activation_tier
        self._workers: Workers | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self) -> Engine:
        cfg, model, device = self.config, self.model, self.device
        workers = self._workers = Workers(("h2d", "d2h", "optimizer"), cfg.timeout_s)
        try:
            self.pipelines = UnitPipelines(
                model, device, self.host_params, self.host_state, self.optimizer, cfg, workers, self.timer,
                self._offloaded, self.collectives, ledger=self._ledger,
            )  # fmt: skip
            resident = self.pipelines.device_updated
            edge = [unit for unit in (model.embedding, model.head) if unit.name not in resident]
            sliding = [block for block in model.blocks if block.name not in resident]
            self.window = SlotWindow(device, sliding, edge, cfg.block_slots, self.dtype)
            for slot in self.window.all_slots():
                slot.grads.zero_()  # alignment padding is never written by compute; keep it zero
            if self.pipelines.layout.host_steps:  # what the plan prices (RunLayout.host_steps)
                self.optimizer.reserve(cfg.transfer_chunk_numel)
            if self._activation_tier is not None:
                self.stash = TierActivationStash(device, self._activation_tier, workers, ledger=self._ledger)
            else:
                self.stash = ActivationStash(device, len(model.blocks), ledger=self._ledger)
            self.loader = SlotLoader(device, self.window, self.pipelines, workers, self.timeline, self.updated)
            self.walk = MicroBatchWalk(model, device, self.dtype, self.loader, self.pipelines, self.stash, self.timer)
        except BaseException:
            workers.stop(abandon=True)
            self._workers = None
            raise
        self.residents = self.pipelines.residents
        self.host_pipeline = self.pipelines.host
        self.transfer = self.pipelines.transfer
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(drain=exc is None)

    def close(self, *, drain: bool = True, keep_host_state: bool = True, master_to_root: bool = False) -> None:
        """Finish (or, with ``drain=False``, abandon) pending work and join every thread. Idempotent.

        ``keep_host_state=False``: the host optimizer state is dropped once the updates are done, before
        the device-resident masters are copied back to the host slab, so a run about to export its model
        does not hold both (see Note [Resident host copies]). ``master_to_root``: see :meth:`drain`.
        """
        if self._closed or self._workers is None:
            self._closed = True
            return
        try:
            if drain and not keep_host_state:
                self._wait_for_updates()
                self.pipelines.unpin_host_state()
                self.host_state.drop()
            if drain:
                self.drain(master_to_root=master_to_root)
        finally:
            self._closed = True
            stuck = self._workers.stop(abandon=not drain)
            if stuck:
                log.error("engine threads did not stop in time: %s", ", ".join(stuck))
            self.window = self.stash = self.pipelines = self.loader = self.walk = None  # type: ignore[assignment]
            self.host_pipeline = self.transfer = None  # type: ignore[assignment]

    @property
    def host_allocations(self) -> HostAllocations:
        """What this engine holds in host RAM for its buffers now, by the plan's name of each buffer,
        counted where each was allocated (slide_core/allocation_ledger.py): the run's side of the plan's
        host buffers, read at any time (after close, what is still held)."""
        return self._ledger.reading()

    @property
    def workers(self) -> Workers:
        if self._workers is None or self._closed:
            raise EngineError("the engine is not running; use it inside `with Engine(...) as engine:`")
        return self._workers

    def drain(self, *, with_state: bool = False, master_to_root: bool = False) -> None:
        """Wait until every pending update has been applied to the host master.

        ``with_state`` also copies device-resident and offloaded units' optimizer state to the host slabs
        (for a checkpoint of the full training state).

        With data parallel every rank's master is gathered whole (a host all-gather, so every rank must
        call it), while the optimizer state stays sharded: each rank's slabs hold its own shards. With
        ``master_to_root`` only rank 0's master is gathered whole (a run that exports from rank 0 and
        ends: the other ranks never hold the whole master).
        """
        self.wait_idle()
        self.pipelines.sync_to_host(self.host_state if with_state else None, to_root=master_to_root)
        if with_state:
            self.host_state.mark_valid()

    def wait_idle(self) -> None:
        """Wait until every pending update is applied, its offloaded state written back and the device
        idle, copying nothing back: a step timed after this starts from an empty pipeline, and
        device-resident masters stay where they train (``drain`` would bring their host pages back, see
        Note [Resident host copies])."""
        self._wait_for_updates()
        self.device.synchronize()
        self.pipelines.flush()
        self.timeline.resolve(block=True)

    def place_streamed(self, names: Collection[str]) -> tuple[frozenset[str], frozenset[str]]:
        """Between two steps: update ``names`` on the device as they stream from the next step on, and every
        other unit of ``EngineConfig.streamable_units`` and ``streamed_units`` on the host. Waits first for
        every pending update and write-back (Note [Re-placement at a step boundary] in replacement.py: the
        streamed path was built for all of them, so the move allocates nothing and changes no value).
        Returns the units moved to the device and to the host; a unit the streamed path was not built for
        raises ``ValueError``."""
        self.wait_idle()  # note: CPU-GPU sync point (once per move, never per step)
        return self.pipelines.place_streamed(names)

    @property
    def streamed_units(self) -> tuple[str, ...]:
        """The units updated on the device as they stream now, in forward order (:meth:`place_streamed`)."""
        placed = self.pipelines.placement.streamed
        return tuple(unit.name for unit in self.model.units if unit.name in placed)

    def _wait_for_updates(self) -> None:
        workers = self.workers
        for name, future in self.updated.items():
            workers.wait(future, f"the update of {name}")

    def checkpoint_arrays(self) -> dict[str, StateSource]:
        """The arrays of a checkpoint (``save_checkpoint``), this rank's part of every unit, read where
        each unit keeps them (engine/checkpointing.py). Waits for every pending update first."""
        self.wait_idle()
        return checkpointing.checkpoint_sources(self.model, self.optimizer, self.pipelines)

    def restore_checkpoint(self, path: Path) -> dict[str, Any]:
        """Resume from checkpoint ``path``, written by any number of processes (engine/checkpointing.py),
        once the engine is running and before its first step; returns the checkpoint's state. Raises
        :class:`~slide_core.checkpoint.CheckpointCorrupt` naming a bad or mismatched file."""
        if self.step_count or self._workers is None:
            raise EngineError("restore_checkpoint needs a running engine that has not stepped yet")
        return checkpointing.restore(path, self.model, self.optimizer, self.pipelines)

    def schedule_state(self) -> dict[str, int | bool]:
        """What a bit-identical resume needs besides the checkpoint's arrays: the Adam step counter, the
        run of skipped non-finite steps, and whether the next step defers its host updates (Note
        [Deferred clipped steps]; speculation and deferral round differently)."""
        return {
            "step": self.step_count,
            "steps_before": self.steps_before,
            "nonfinite_streak": self.clip_policy.nonfinite_streak,
            "defer_clipped_updates": self.clip_policy.defer_next,
        }

    def restore_schedule_state(self, state: Mapping[str, int | bool]) -> None:
        """Continue from :meth:`schedule_state` of a saved run (keys it lacks keep a fresh run's values)."""
        self.step_count = int(state.get("step", self.step_count))
        self.steps_before = int(state.get("steps_before", self.steps_before))
        self.clip_policy.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        self.clip_policy.defer_next = bool(state.get("defer_clipped_updates", False))

    # -- one optimizer step ----------------------------------------------------------------------------
    def step(self, micro_batches: Sequence[MicroBatchLike], lr: float) -> StepResult:
        """Run forward and backward over ``micro_batches`` and update every unit once.

        Each micro-batch is host tensors, each (B, S) int64: ``(input_ids, labels)``, or ``(input_ids,
        labels, position_ids)`` for rows packed with several documents (see Note [Packed micro-batches]
        in micro_batch.py)."""
        workers = self.workers
        if not micro_batches:
            raise ValueError("a step needs at least one micro-batch")
        began = time.perf_counter()
        batches = [split_micro_batch(micro_batch, index) for index, micro_batch in enumerate(micro_batches)]
        loss_tokens = sum(self.model.loss_token_count(batch.labels) for batch in batches)
        tokens = sum(int(batch.input_ids.numel()) for batch in batches)
        loss_tokens, tokens = self.pipelines.sum_counts(loss_tokens, tokens)  # over every rank
        if loss_tokens == 0:
            raise ValueError("no label tokens in this step's micro-batches (every label is -100)")
        self.step_count += 1
        ctx = self._begin_step(len(batches), lr)
        schedule = self.walk.schedule(len(batches), training=True)
        self.window.start_step(schedule)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        position = 0
        for batch in batches:
            position = self.walk.train(batch, loss_tokens, loss_sum, schedule, position, ctx)
        workers.check()
        total, squares = self.pipelines.sum_loss_and_norms(loss_sum)  # note: CPU-GPU sync point (once a step)
        self.pipelines.sum_host_squares(ctx, workers, self.transfer.last)
        try:
            grad_norm = ctx.clip.finish(ctx, squares, workers, self.pipelines.routes, self.transfer.last)
        finally:
            if ctx.clip.skipped:
                self.step_count = ctx.step - 1  # the Adam step counter does not advance
        return StepResult(
            step=ctx.step,
            loss=total / loss_tokens,
            tokens=tokens,
            loss_tokens=loss_tokens,
            lr=lr,
            wall_s=time.perf_counter() - began,
            grad_norm=grad_norm,
            skipped=ctx.clip.skipped,
        )

    def unit_times(self) -> dict[str, UnitTimes]:
        """Per-unit phase times collected since the last call (completed device spans only)."""
        return self.timeline.take()

    def _begin_step(self, micro_batches: int, lr: float) -> StepContext:
        """The step's context: fresh 'updated' futures (loads wait for the previous step's), the
        contributions each unit gets, and the clip strategy of this step."""
        model = self.model
        self.loader.ready_after, self.updated = self.updated, {unit.name: Future() for unit in model.units}
        expected = {unit.name: micro_batches for unit in model.units}
        if model.head.borrowed:  # the head's share of the embedding's gradient, then the embedding's own
            expected[model.embedding.name] += micro_batches
        clip = self.clip_policy.for_step()
        on_device = self.pipelines.updated_on_device(clip, expected)
        ctx = StepContext(
            self.step_count, lr, micro_batches, expected, clip, self.updated, on_device, self.steps_before
        )
        self.pipelines.begin_step(ctx)
        return ctx


def _ledger_of(
    host_params: HostParameters, optimizer: Optimizer, state_tier: Tier | None, activation_tier: Tier | None
) -> AllocationLedger:
    """A new engine's ledger, with what it borrows already counted: the master's planes (allocated by the
    caller, trained by this engine), the optimizer's scratch and the tiers' own buffers (both read from
    them whenever the ledger is read). A tier in memory holds what it stores (optimizer state, block
    inputs); one on disk holds staging."""
    ledger = AllocationLedger()
    for plane in host_params.planes.values():
        ledger.record(host_params, "master_fp32", plane)
    ledger.hold(optimizer, "optimizer_scratch", optimizer.held_host_bytes)
    if state_tier is not None:
        ledger.hold(state_tier, "nvme_staging" if state_tier.on_disk else "optimizer_state", state_tier.host_bytes)
    if activation_tier is not None:
        ledger.hold(
            activation_tier,
            "nvme_staging" if activation_tier.on_disk else "activation_stash",
            activation_tier.host_bytes,
        )
    return ledger


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future
