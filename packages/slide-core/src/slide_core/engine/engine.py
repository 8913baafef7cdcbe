"""The sliding-window training engine: the schedule of one optimizer step, read as one page.

:meth:`Engine.step` takes a list of micro-batches, each host tensors (B, S) int64: ``(input_ids, labels)``
or, for rows packed with several documents, ``(input_ids, labels, position_ids)`` (Note [Packed
micro-batches] in micro_batch.py). For each micro-batch:
1. Forward. Each unit waits for its slot's h2d, prefetches the units after it, computes without grad,
   and sends its output (the next block's input) to pinned host memory.
2. Head. Loss and the head's gradients come out of one forward-with-grad.
3. Backward, last block to first. Each block prefetches the one before it (params and input activation),
   recomputes with grad and backpropagates.
Every gradient goes to its unit's pipeline (pipeline.py), which carries it to the unit's update: across
PCIe to the host optimizer thread (host_pipeline.py, offloaded_pipeline.py) or on the device
(resident_pipeline.py). The step's clip strategy (clip_strategy.py) decides what becomes of each final
gradient and ends the step. The engine itself holds the schedule, the slots it loads into, prefetching and
the lifecycle. docs/design/engine.md draws the whole pipeline (threads, streams, buffers and their owners)
and holds the notes cited here without a file.

:meth:`Engine.evaluate` runs a forward-only pass through the same window (evaluation.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slide_core.device import Device
from slide_core.host_params import HostParameters
from slide_core.optim.state_formats import QUANT_BLOCK
from slide_core.optimizer import Optimizer
from slide_core.tier import Tier
from slide_core.unit import SlideModel, Unit

from . import checkpointing
from .activations import ActivationStash, TierActivationStash
from .clip_strategy import ClipPolicy
from .config import EngineConfig
from .context import StepContext
from .evaluation import Evaluation
from .grad_transfer import GradTransfer
from .host_pipeline import HostPipeline
from .host_state import HostState
from .master_format import check_master_format
from .micro_batch import HostMicroBatch, MicroBatchLike, split_micro_batch
from .resident import ResidentUnits
from .slots import ParamSlot, SlotWindow, Visit
from .state_offload import OffloadedState
from .state_source import StateSource
from .timeline import ComputeTimer, Timeline, UnitTimes
from .unit_pipelines import UnitPipelines
from .workers import EngineError, Workers

if TYPE_CHECKING:
    from slide_core.distributed import ProcessGroupContext

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
        process_group: ProcessGroupContext | None = None,
    ) -> None:
        """``state_tier`` (an open :class:`Tier`) holds the Adam state of ``config.offloaded_units``;
        ``activation_tier`` (open), when given, holds the blocks' boundary activations instead of RAM.

        ``process_group`` (open, world size > 1) makes this engine one rank of a data-parallel run: each
        rank steps on its own part of every step's batch, and every unit's master and optimizer state is
        sharded across the ranks (sharded_pipeline.py, docs/distributed.md). World size 1 is a
        single-process run."""
        if host_params.model is not model:
            raise ValueError("host_params was built for a different model")
        if not device.is_open:
            raise ValueError("open the device first: `with device:` or device.open()")
        cfg = self.config = config or EngineConfig()
        if cfg.clipping and not optimizer.corrects:
            raise ValueError(
                f"max_grad_norm needs an optimizer that can correct an applied update (Optimizer.correct); "
                f"{type(optimizer).__name__} cannot"
            )
        check_master_format(host_params, cfg, optimizer)
        self.model, self.device, self.host_params, self.optimizer = model, device, host_params, optimizer
        self._group = process_group if process_group is not None and process_group.is_distributed else None
        if self._group is not None:
            _check_data_parallel(self._group, device, cfg)
        self.dtype = cfg.compute_dtype
        self.step_count = 0
        self.timeline = Timeline(cfg.record_timings)
        self.timer = ComputeTimer(device, self.timeline)  # compute-stream spans, shared with the pipelines
        self.clip_policy = ClipPolicy(cfg)
        _check_state_format(optimizer, cfg, self._group)
        self._offloaded = OffloadedState.of_config(model, cfg, state_tier, optimizer.state_arrays)
        elsewhere = {*cfg.resident_units, *cfg.offloaded_units}
        self.host_state = HostState(model, host_params, optimizer.state_arrays, elsewhere)
        self.updated: dict[str, Future[None]] = {unit.name: _done() for unit in model.units}
        """Each unit's latest 'updated' future: what its next load waits for (Note [Update futures])."""
        self._ready_after = self.updated  # what this step's (or evaluation's) loads wait for
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
                self._offloaded, self._group,
            )  # fmt: skip
            resident = self.pipelines.device_updated
            edge = [unit for unit in (model.embedding, model.head) if unit.name not in resident]
            sliding = [block for block in model.blocks if block.name not in resident]
            self.window = SlotWindow(device, sliding, edge, cfg.block_slots, self.dtype)
            for slot in self.window.all_slots():
                slot.grads.zero_()  # alignment padding is never written by compute; keep it zero
            self.optimizer.reserve(cfg.transfer_chunk_numel)
            if self._activation_tier is not None:
                self.stash = TierActivationStash(device, self._activation_tier, workers)
            else:
                self.stash = ActivationStash(device, len(model.blocks))
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
                self.host_state.drop()
            if drain:
                self.drain(master_to_root=master_to_root)
        finally:
            self._closed = True
            stuck = self._workers.stop(abandon=not drain)
            if stuck:
                log.error("engine threads did not stop in time: %s", ", ".join(stuck))
            self.window = self.stash = self.pipelines = None  # type: ignore[assignment]
            self.host_pipeline = self.transfer = None  # type: ignore[assignment]

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
            "nonfinite_streak": self.clip_policy.nonfinite_streak,
            "defer_clipped_updates": self.clip_policy.defer_next,
        }

    def restore_schedule_state(self, state: Mapping[str, int | bool]) -> None:
        """Continue from :meth:`schedule_state` of a saved run (keys it lacks keep a fresh run's values)."""
        self.step_count = int(state.get("step", self.step_count))
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
        sharded = self.pipelines.sharded
        if sharded is not None:  # every rank's gradients are divided by every rank's label tokens
            loss_tokens, tokens = sharded.sum_counts(loss_tokens, tokens)
        if loss_tokens == 0:
            raise ValueError("no label tokens in this step's micro-batches (every label is -100)")
        self.step_count += 1
        ctx = self._begin_step(len(batches), lr)
        schedule = self._schedule(len(batches))
        self.window.start_step(schedule)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        position = 0
        for batch in batches:
            position = self._micro_batch(batch, loss_tokens, loss_sum, schedule, position, ctx)
        workers.check()
        total, squares = self._read_loss_and_norms(loss_sum)
        if sharded is not None:
            sharded.sum_host_squares(ctx, workers, self.transfer.last)
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
        self._ready_after, self.updated = self.updated, {unit.name: Future() for unit in model.units}
        expected = {unit.name: micro_batches for unit in model.units}
        if model.head.borrowed:  # the head's share of the embedding's gradient, then the embedding's own
            expected[model.embedding.name] += micro_batches
        ctx = StepContext(
            self.step_count,
            lr,
            micro_batches,
            expected,
            self.clip_policy.for_step(),
            self.updated,
            self.pipelines.device_updated,
        )
        self.pipelines.begin_step(ctx)
        return ctx

    def _schedule(self, micro_batches: int) -> list[Visit]:
        model = self.model
        schedule: list[Visit] = []
        for mb in range(micro_batches):
            schedule.append(Visit(model.embedding, "forward", mb))
            schedule.extend(Visit(block, "forward", mb) for block in model.blocks)
            schedule.append(Visit(model.head, "head", mb))
            schedule.extend(Visit(block, "backward", mb) for block in reversed(model.blocks))
            schedule.append(Visit(model.embedding, "backward", mb))
        return schedule

    def _read_loss_and_norms(self, loss_sum: torch.Tensor) -> tuple[float, list[float] | None]:
        """The step's summed loss and every unit's device-side squared gradient norm (Note [Gradient norm
        of every step]), in one read. note: CPU-GPU sync point (once per step, for the reported loss).
        With data parallel both are summed over the ranks first (sharded_pipeline.py)."""
        norms = self.pipelines.norms
        if self.pipelines.sharded is not None:
            return self.pipelines.sharded.sum_loss_and_norms(loss_sum, norms)
        if norms is None:
            return float(loss_sum), None
        values = torch.cat((loss_sum.reshape(1), norms.on_device)).tolist()
        return values[0], values[1:]

    def _micro_batch(
        self,
        batch: HostMicroBatch,
        loss_tokens: int,
        loss_sum: torch.Tensor,
        schedule: list[Visit],
        position: int,
        ctx: StepContext,
    ) -> int:
        model, device = self.model, self.device
        ids, lab, positions = batch.to_device(device.torch_device)
        inputs = model.prepare_inputs(ids, lab, self.dtype, position_ids=positions)
        blocks = list(model.blocks)
        scale = 1.0 / loss_tokens

        # 1. forward: embedding, then blocks; each block's input slides out to the host.
        x = self._compute(position, schedule, lambda p: model.embedding.forward(p, ids, inputs), grad=False)
        position += 1
        for index, block in enumerate(blocks):
            if index == 0:
                self.stash.ensure(tuple(x.shape), x.dtype)
            self.stash.save(index, x, device.record_event("compute"))
            x = self._compute(position, schedule, lambda p, b=block, h=x: b.forward(p, h, inputs), grad=False)
            position += 1

        # 2. head: loss and its gradients in one pass.
        grad_x = self._head(position, schedule, x, inputs, scale, loss_sum, ctx)
        position += 1

        # 3. backward: recompute each block from its stashed input, last to first.
        for index in reversed(range(len(blocks))):
            if index > 0:
                self.stash.prefetch(index - 1)
            grad_x = self._backward_block(position, schedule, index, grad_x, inputs, ctx)
            position += 1
        self._backward_embedding(position, schedule, ids, inputs, grad_x, ctx)
        return position + 1

    # -- visits ----------------------------------------------------------------------------------------
    def _compute(self, position: int, schedule: list[Visit], fn: Callable, *, grad: bool) -> torch.Tensor:
        visit = schedule[position]
        slot = self._acquire(position, schedule, visit.unit)
        params = visit.unit.layout.views(slot.params)
        start = self.timer.start()
        with torch.set_grad_enabled(grad):
            out = fn(params)
        self.timer.stop(visit.unit.name, visit.phase, start)
        slot.compute_done = self.device.record_event("compute")
        return out

    def _head(
        self,
        position: int,
        schedule: list[Visit],
        x: torch.Tensor,
        inputs: object,
        scale: float,
        loss_sum: torch.Tensor,
        ctx: StepContext,
    ) -> torch.Tensor:
        head, embedding = self.model.head, self.model.embedding
        mb = schedule[position].micro_batch
        slot = self._acquire(position, schedule, head)
        params = _leaves(head.layout.views(slot.params))
        own_share, lent_share = ctx.contribution(head, mb), ctx.contribution(embedding, mb, share=0)
        lender: ParamSlot | None = None
        if head.borrowed:
            lender = self._acquire(position, schedule, embedding, pinned={slot.index})
            views = embedding.layout.views(lender.params)
            params.update({mine: views[theirs].detach().requires_grad_() for mine, theirs in head.borrowed.items()})
        # The slot views the head's forward may write its gradients into (``Unit.grads_in_forward``): a
        # fused loss then puts the head matrix's gradient where its pipeline streams it from, with no
        # (vocab, hidden) temporary and no copy.
        grad_into: dict[str, torch.Tensor] = {}
        for name in head.grads_in_forward:
            unit, target, own_name, contribution = head, slot, name, own_share
            if name in head.borrowed:
                assert lender is not None
                unit, target, own_name, contribution = embedding, lender, head.borrowed[name], lent_share
            buffer = self.pipelines[unit.name].writable_grads(unit, target, contribution, ctx)
            if buffer is not None:
                grad_into[name] = unit.layout.views(buffer)[own_name]
        start = self.timer.start()
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            loss = head.forward_into(params, x, inputs, grad_into)
            names = list(params)
            grads = torch.autograd.grad(loss * scale, [x, *params.values()], allow_unused=True)
        loss_sum.add_(loss.detach().float())
        self.timer.stop(head.name, "head", start)
        own = {name: g for name, g in zip(names, grads[1:], strict=True) if name not in head.borrowed}
        self.pipelines[head.name].contribute(head, slot, own, own_share, ctx)
        slot.compute_done = self.device.record_event("compute")
        if lender is not None:
            shared = {theirs: grads[1 + names.index(mine)] for mine, theirs in head.borrowed.items()}
            self.pipelines[embedding.name].contribute(embedding, lender, shared, lent_share, ctx)
            lender.compute_done = slot.compute_done
        return grads[0]

    def _backward_block(
        self, position: int, schedule: list[Visit], index: int, grad_out: torch.Tensor, inputs: object, ctx: StepContext
    ) -> torch.Tensor:
        block = self.model.blocks[index]
        slot = self._acquire(position, schedule, block)
        params = _leaves(block.layout.views(slot.params))
        start = self.timer.start()
        x = self.stash.load(index).detach().requires_grad_()
        with torch.enable_grad():
            y = block.forward(params, x, inputs)
            grads = torch.autograd.grad(y, [x, *params.values()], grad_out, allow_unused=True)
        self.timer.stop(block.name, "backward", start)
        contribution = ctx.contribution(block, schedule[position].micro_batch)
        self.pipelines[block.name].contribute(block, slot, dict(zip(params, grads[1:], strict=True)), contribution, ctx)
        done = self.device.record_event("compute")
        slot.compute_done = done
        self.stash.release(index, done)
        return grads[0]

    def _backward_embedding(
        self,
        position: int,
        schedule: list[Visit],
        ids: torch.Tensor,
        inputs: object,
        grad_out: torch.Tensor,
        ctx: StepContext,
    ) -> None:
        embedding = self.model.embedding
        slot = self._acquire(position, schedule, embedding)
        params = _leaves(embedding.layout.views(slot.params))
        start = self.timer.start()
        with torch.enable_grad():
            y = embedding.forward(params, ids, inputs)
            grads = torch.autograd.grad(y, list(params.values()), grad_out, allow_unused=True)
        self.timer.stop(embedding.name, "backward", start)
        share = 1 if self.model.head.borrowed else 0  # after the head's share (see ``_begin_step``)
        contribution = ctx.contribution(embedding, schedule[position].micro_batch, share)
        self.pipelines[embedding.name].contribute(
            embedding, slot, dict(zip(params, grads, strict=True)), contribution, ctx
        )
        slot.compute_done = self.device.record_event("compute")

    # -- residency -------------------------------------------------------------------------------------
    def _acquire(self, position: int, schedule: list[Visit], unit: Unit, pinned: set[int] | None = None) -> ParamSlot:
        """The slot holding ``unit`` for the visit at ``position``; loads it if needed, then prefetches."""
        window, workers = self.window, self.workers
        window.advance(position)
        pinned = set(pinned or ())
        fixed = self.pipelines.fixed.get(unit.name)
        if fixed is not None:
            self._prefetch(position, schedule, pinned)
            return fixed
        slot = window.resident(unit)
        if slot is None:
            slot = window.slot_for(unit, position, pinned)
            if slot is None:
                raise EngineError(f"no device slot free for {unit.name}; raise block_slots")
            self._load(slot, unit)
        pinned.add(slot.index)
        self._prefetch(position, schedule, pinned)
        began = time.perf_counter()
        assert slot.loaded is not None
        loaded = workers.wait(slot.loaded, f"the parameters of {unit.name}")
        self.timeline.host_span(unit.name, "wait", (time.perf_counter() - began) * 1e3)
        self.device.wait_event("compute", loaded)
        return slot

    def _prefetch(self, position: int, schedule: list[Visit], pinned: set[int]) -> None:
        horizon = min(len(schedule), position + 1 + len(self.window.all_slots()))
        for ahead in range(position + 1, horizon):
            unit = schedule[ahead].unit
            if unit.name in self.pipelines.fixed or self.window.resident(unit) is not None:
                continue
            slot = self.window.slot_for(unit, ahead, pinned)
            if slot is None:
                continue
            self._load(slot, unit)

    def _load(self, slot: ParamSlot, unit: Unit) -> None:
        slot.unit = unit
        load = self.pipelines[unit.name].load
        slot.loaded = self.workers["h2d"].submit(load, unit, slot, self._ready_after[unit.name], slot.compute_done)


def _check_data_parallel(group: ProcessGroupContext, device: Device, config: EngineConfig) -> None:
    """Refuse what a data-parallel engine cannot run, in one line each."""
    if group.backend == "nccl" and device.torch_device.type != "cuda":
        raise ValueError(f"the nccl process group needs a cuda device, got {device.torch_device.type}")
    if group.backend == "nccl" and device.torch_device.index != group.device_index:
        raise ValueError(
            f"rank {group.rank} computes on {device.torch_device}, but its process group uses "
            f"cuda:{group.device_index} (its local rank's GPU); build the device with index=group.device_index"
        )
    if group.backend == "gloo" and device.is_accelerator:
        raise ValueError(f"a {device.torch_device.type} device needs the nccl process group, got gloo")
    if not group.is_open:
        raise ValueError("open the process group first: `with ProcessGroupContext(...) as group:`")


def _check_state_format(optimizer: Optimizer, config: EngineConfig, group: ProcessGroupContext | None) -> None:
    """Refuse, in one line, the placements a compact optimizer state does not run with (yet)."""
    state_format = optimizer.state_format
    if state_format == "fp32":
        return
    if all(array.dtype == torch.float32 for array in optimizer.state_arrays):
        raise ValueError(
            f"{type(optimizer).__name__} keeps fp32 state, but its config asks for {state_format}; "
            "use CompactAdamW (build_optimizer picks it)"
        )
    if state_format == "int8" and config.transfer_chunk_numel % QUANT_BLOCK:
        raise ValueError(
            f"int8 optimizer state needs transfer_chunk_numel to be a multiple of {QUANT_BLOCK} (its block), "
            f"got {config.transfer_chunk_numel}"
        )
    if group is not None and state_format == "int8":
        raise ValueError(
            "int8 optimizer state is not supported with data parallel yet (its shards would split int8 blocks); "
            "use bf16 or fp32"
        )


def _leaves(views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bind slot views as autograd leaves: gradients flow to them, storage stays the slot's."""
    return {name: view.detach().requires_grad_() for name, view in views.items()}


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future
