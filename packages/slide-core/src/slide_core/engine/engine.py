"""The sliding-window training engine: one optimizer step, read as one page.

:meth:`Engine.step` takes a list of micro-batches, each host tensors (B, S) int64: ``(input_ids, labels)``
or, for rows packed with several documents, ``(input_ids, labels, position_ids)`` (any sequence of those,
such as a NamedTuple; see Note [Packed micro-batches] in micro_batch.py). For each micro-batch:
1. Forward. Each unit waits for its slot's h2d, prefetches the units after it, computes without grad,
   and sends its output (the next block's input) to pinned host memory.
2. Head. Loss and the head's gradients come out of one forward-with-grad; their d2h starts at once.
3. Backward, last block to first. Each block prefetches the one before it (params and input activation),
   recomputes with grad, backpropagates, and hands its gradients to the d2h thread, which streams them
   in chunks to the optimizer thread. The optimizer updates the fp32 master while the device computes
   earlier blocks.
On the last micro-batch each unit's last gradient chunk triggers its update; earlier micro-batches (and a
tied head's share of the embedding gradient) accumulate in fp32 on the host.

The per-unit gradient path (device buffer -> host -> optimizer, and the end-of-step clipping decision)
lives in gradient_path.py. Threads: main (issues compute), ``h2d`` (waits for a unit's update, then loads it), ``d2h`` (streams
gradients into the ring), ``optimizer`` (applies chunks). See Note [Worker failures] in workers.py.

With ``max_grad_norm > 0`` those updates are speculative (each unit clipped by its own norm only) and
gradients land in a full-model store instead of the ring; at the end of the step the main thread forms the
global norm and, when it clips or is not finite, has every update corrected or taken back (clipping.py).
After a step that clipped, the host updates wait for the norm instead (Note [Deferred clipped steps]).
Per-unit squared gradient norms are computed on the device whenever ``skip_nonfinite``, clipping or
``report_grad_norm`` (the default) is on.

Note [Gradient norm of every step]: ``StepResult.grad_norm`` is the 2-norm over every parameter's final
gradient of the step, as ``torch.nn.utils.get_total_norm`` over plain PyTorch's ``.grad`` would give.
A unit whose final gradient exists on the device (one contribution, or a device-resident unit's slot or
fp32 accumulator) has its squared norm formed there on the compute stream right after the gradient
(``UnitNorms``); the main thread reads all of them together with the loss sum, in the one transfer it
makes per step anyway. A host-updated unit with several contributions (gradient accumulation, a tied
embedding's head share) has its final gradient only in its host fp32 accumulator: the optimizer thread
sums its squared norm chunk by chunk as it adds the last contribution (``GradChunk.host_squares``), and
the main thread waits for those units' 'updated' futures before it adds them in; a host-side wait, no
device sync. With clipping the same sums come from ``ClipStep``. ``report_grad_norm=False`` drops that
wait (see EngineConfig). Tested by ``test_grad_norm_matches_get_total_norm``.

:meth:`Engine.evaluate` runs a forward-only pass through the same window (evaluation.py).

Note [Resident host copies]: a device-resident unit's master is updated on the GPU, so its range of the
host slab is stale between a drain and the next one. When the caller allocated the slab unpinned
(``HostParameters(model)``), the engine pins only the host-updated units' ranges and gives the resident
ranges' pages back to the OS (``release_pages``) after copying them to the GPU, and again at the first
step after every drain (which copies the masters back for the caller to read). Fresh Adam state is zeroed
after that release, so the load-time master and the training buffers never add up in the host's peak. A
slab from ``device.alloc_pinned`` is pinned whole and is left as it is. ``close(keep_host_state=False)``
drops the host optimizer state before the final copy-back, for a run that goes on to export. Tested by
``test_resident_host_copies_are_released``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slide_core.checkpoint import load_checkpoint
from slide_core.device import Device, Event
from slide_core.host_memory import release_pages
from slide_core.host_params import HostParameters
from slide_core.optim.adamw import TorchAdamW
from slide_core.optimizer import Optimizer
from slide_core.tier import Tier
from slide_core.unit import SlideModel, Unit

from .activations import ActivationStash, TierActivationStash
from .clipping import (
    ADAMW_STATE,
    AdamWCorrection,
    ClipStep,
    ScaledGrads,
    UnitNorms,
)
from .config import EngineConfig
from .evaluation import Evaluation
from .grad_ring import GradRing, GradStore
from .gradient_path import GradientPath
from .micro_batch import HostMicroBatch, MicroBatchLike, split_micro_batch
from .resident import ResidentUnits
from .slots import ParamSlot, SlotWindow, Visit
from .state_offload import OffloadedState
from .state_source import StateSink, StateSource
from .timeline import Timeline, UnitTimes
from .updates import UnitUpdates
from .workers import EngineError, Workers

__all__ = ["Engine", "StepResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step measured. ``loss`` is the mean over every label token the step consumed,
    computed before the step's update.

    ``grad_norm`` is the global gradient 2-norm before clipping (Note [Gradient norm of every step]; None
    only with clipping off and ``EngineConfig.report_grad_norm`` False). ``skipped``
    says the step's gradients were not finite and the step was taken back exactly; ``step`` is then the
    number the step would have had, and the next step reuses it (the Adam step counter did not advance).
    """

    step: int
    loss: float
    tokens: int
    loss_tokens: int
    lr: float
    wall_s: float
    grad_norm: float | None = None
    skipped: bool = False


class Engine(GradientPath, Evaluation):
    """Trains a :class:`SlideModel` whose fp32 master lives in ``host_params`` on ``device``.

    A context manager: entering allocates slots, rings and threads; leaving drains pending updates (when
    no exception is in flight), joins every thread and drops every buffer. Two engines can coexist.
    """

    def __init__(
        self,
        model: SlideModel,
        device: Device,
        host_params: HostParameters,
        optimizer: Optimizer,
        config: EngineConfig | None = None,
        state_tier: Tier | None = None,
        activation_tier: Tier | None = None,
    ) -> None:
        """``state_tier`` (an open :class:`Tier`) holds the Adam state of ``config.offloaded_units``;
        ``activation_tier`` (open), when given, holds the blocks' boundary activations instead of RAM."""
        if host_params.model is not model:
            raise ValueError("host_params was built for a different model")
        if not device.is_open:
            raise ValueError("open the device first: `with device:` or device.open()")
        self._activation_tier = activation_tier
        self.model = model
        self.device = device
        self.host_params = host_params
        self.optimizer = optimizer
        self.config = config or EngineConfig()
        self.dtype = self.config.compute_dtype
        self.step_count = 0
        self.timeline = Timeline(self.config.record_timings)
        self._forward_position = {unit.name: index for index, unit in enumerate(model.units)}
        self.clipping = self.config.clipping
        if self.clipping and tuple(optimizer.state_names) != ADAMW_STATE:
            raise ValueError(
                f"max_grad_norm needs an AdamW optimizer (state {ADAMW_STATE}); got state {optimizer.state_names}"
            )
        corrector = AdamWCorrection(optimizer.config, self.config.transfer_chunk_numel) if self.clipping else None
        offloaded = None
        if self.config.offloaded_units:
            if state_tier is None:
                raise ValueError("offloaded_units needs a state_tier (e.g. slide_io's nvme tier)")
            unknown = set(self.config.offloaded_units) - {u.name for u in model.units}
            both = set(self.config.offloaded_units) & set(self.config.resident_units)
            if unknown or both:
                raise ValueError(f"offloaded_units: unknown {sorted(unknown)} or also resident {sorted(both)}")
            chosen = [u for u in model.units if u.name in self.config.offloaded_units]
            offloaded = OffloadedState(state_tier, chosen, optimizer.state_names, self.config.timeout_s)
        self.updates = UnitUpdates(
            model,
            host_params,
            optimizer,
            self.timeline,
            corrector,
            frozenset(self.config.resident_units),
            offloaded,
        )
        self._workers: Workers | None = None
        self._lean_host = False  # see Note [Resident host copies]
        self._resident_host_current = False
        self._closed = False
        self._nonfinite_streak = 0
        self._defer_next = False  # see Note [Deferred clipped steps] in clipping.py

    # -- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self) -> Engine:
        cfg = self.config
        model = self.model
        resident = set(cfg.resident_units)
        offloaded = self.updates.offloaded
        for name in offloaded.units if offloaded is not None else ():
            if self.updates.host_state_valid[name]:  # a resumed checkpoint: seed the tier from the host
                offloaded.load_from(name, self.updates.state_views(name))
        self.residents = ResidentUnits(
            model,
            cfg.resident_units,
            self.device,
            self.host_params,
            {
                name: self.updates.state_views(name) if self.updates.host_state_valid[name] else None
                for name in cfg.resident_units
            },
            TorchAdamW(self.optimizer.config),
            self.dtype,
            cfg.transfer_chunk_numel,
        )
        self._pin_and_release_host(resident)
        self.updates.zero_fresh_state()
        edge = [unit for unit in (model.embedding, model.head) if unit.name not in resident]
        sliding = [block for block in model.blocks if block.name not in resident]
        self.window = SlotWindow(self.device, sliding, edge, cfg.block_slots, self.dtype)
        for slot in self.window.all_slots():
            slot.grads.zero_()  # alignment padding is never written by compute; keep it zero
        host_units = [unit for unit in model.units if unit.name not in resident]
        self.ring: GradRing | None = None
        self.store: GradStore | None = None
        if self.clipping:  # see grad_ring.py: the store replaces the ring
            self.store = GradStore(self.device, host_units, self.dtype)
        else:
            host_numel = sum(u.layout.numel for u in model.units if u.name not in resident)
            slots = cfg.ring_slots(host_numel)
            self.ring = GradRing(self.device, slots, cfg.transfer_chunk_numel, self.dtype)
        # Norms that decide something (clipping, the non-finite checks), or only reported (Note [Gradient
        # norm of every step]): with skip_nonfinite off, a reported norm never stops the engine.
        self._checks_norms = self.clipping or cfg.skip_nonfinite
        wants_norms = self._checks_norms or cfg.report_grad_norm
        self.norms = UnitNorms(self.device, model.units) if wants_norms else None
        self._resident_corrector = AdamWCorrection(self.optimizer.config, cfg.transfer_chunk_numel)
        self._resident_scaled = ScaledGrads()
        self._consumed: dict[str, Future[None]] = {}  # d2h thread only, see Note [Grad store reuse]
        self._last_d2h: Future[Event] | None = None
        self.optimizer.reserve(cfg.transfer_chunk_numel)
        self._workers = Workers(("h2d", "d2h", "optimizer"), cfg.timeout_s)
        if self._activation_tier is not None:
            self.stash = TierActivationStash(self.device, self._activation_tier, self._workers)
        else:
            self.stash = ActivationStash(self.device, len(model.blocks))
        return self

    def _pin_and_release_host(self, resident: set[str]) -> None:
        """See Note [Resident host copies]: pin the host-updated units' master ranges, and give back the
        pages of the device-resident ones, when the caller left the slab unpinned."""
        self._lean_host = not self.host_params.slab.is_pinned()
        self._resident_host_current = False
        if not self._lean_host:
            return  # a pinned slab (``device.alloc_pinned``): its pages cannot be given back
        # Before pinning: a page-locked registration may keep the kernel from dropping pages nearby.
        self._release_resident_host()
        host_updated = itertools.groupby(self.model.units, key=lambda unit: unit.name not in resident)
        for is_host_updated, group in host_updated:
            run = list(group)
            if is_host_updated:  # one registration per contiguous run of the slab
                self.device.pin_host_range(self.host_params.span(run[0], run[-1]))

    def _release_resident_host(self) -> None:
        if self._lean_host:
            for name in self.residents.units:
                master = self.host_params.flat(name)
                nbytes = master.numel() * master.element_size()
                if release_pages(master) == 0 and nbytes >= 1 << 22:
                    log.warning(
                        "could not give back the host pages of %s (madvise failed): host memory will run "
                        "%.2f GiB above the plan",
                        name,
                        nbytes / 2**30,
                    )
        self._resident_host_current = False

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(drain=exc is None)

    def close(self, *, drain: bool = True, keep_host_state: bool = True) -> None:
        """Finish (or, with ``drain=False``, abandon) pending work and join every thread. Idempotent.

        ``keep_host_state=False``: the host optimizer state is dropped once the updates are done, before
        the device-resident masters are copied back to the host slab, so a run about to export its model
        does not hold both (see Note [Resident host copies]).
        """
        if self._closed or self._workers is None:
            self._closed = True
            return
        try:
            if drain and not keep_host_state:
                self._wait_for_updates()
                self.updates.drop_host_state()
            if drain:
                self.drain()
        finally:
            self._closed = True
            stuck = self._workers.stop(abandon=not drain)
            if stuck:
                log.error("engine threads did not stop in time: %s", ", ".join(stuck))
            self.window = None  # type: ignore[assignment]
            self.ring = None
            self.store = None
            self.stash = None  # type: ignore[assignment]

    @property
    def workers(self) -> Workers:
        if self._workers is None or self._closed:
            raise EngineError("the engine is not running; use it inside `with Engine(...) as engine:`")
        return self._workers

    def drain(self, *, with_state: bool = False) -> None:
        """Wait until every pending update has been applied to the host master.

        ``with_state`` also copies device-resident units' optimizer state to the host slabs (for a
        checkpoint of the full training state).
        """
        self.wait_idle()
        offloaded = self.updates.offloaded
        if with_state:
            self.residents.sync_to_host({name: self.updates.state_views(name) for name in self.residents.units})
            for name in offloaded.units if offloaded is not None else ():
                offloaded.copy_to(name, self.updates.state_views(name))
            self.updates.mark_host_state_valid()
        else:
            self.residents.sync_to_host()
        self._resident_host_current = True  # until the next step (Note [Resident host copies])

    def wait_idle(self) -> None:
        """Wait until every pending update is applied, its offloaded state written back and the device
        idle, copying nothing back: a step timed after this starts from an empty pipeline, and
        device-resident masters stay where they train (``drain`` would bring their host pages back, see
        Note [Resident host copies])."""
        self._wait_for_updates()
        self.device.synchronize()
        if self.updates.offloaded is not None:
            self.updates.offloaded.flush()
        self.timeline.resolve(block=True)

    def _wait_for_updates(self) -> None:
        workers = self.workers
        for name, future in self.updates.updated.items():
            workers.wait(future, f"the update of {name}")

    def checkpoint_arrays(self) -> dict[str, StateSource]:
        """The arrays of a checkpoint (``save_checkpoint``): one :class:`StateSource` for the fp32 master
        and one per optimizer state, each reading device-resident and offloaded units where they live,
        so a save touches no host memory for them (see state_source.py). Waits for every pending update
        first, and copies nothing back: resident masters stay off the host."""
        self.wait_idle()
        return {
            name: StateSource(name, self.model.units, views, self.residents.units, self.updates.offloaded)
            for name, views in self._unit_views().items()
        }

    def restore_checkpoint(self, path: Path) -> dict[str, Any]:
        """Resume from a checkpoint written from :meth:`checkpoint_arrays`: every unit's master and Adam
        state is streamed to where the unit keeps it (host slabs, the GPU, the state tier), block by
        verified block, so a resume needs no more host memory than training. Call it once the engine
        is running and before its first step; returns the checkpoint's state (its ``extra``, ``step``).
        Raises :class:`~slide_core.checkpoint.CheckpointCorrupt` naming a bad or mismatched file."""
        if self.step_count or self._workers is None:
            raise EngineError("restore_checkpoint needs a running engine that has not stepped yet")
        sinks = {
            name: StateSink(name, self.model.units, views, self.residents.units, self.updates.offloaded)
            for name, views in self._unit_views().items()
        }
        state = load_checkpoint(path, sinks)
        self.residents.refresh_params()
        return state

    def _unit_views(self) -> dict[str, dict[str, torch.Tensor]]:
        """For each checkpointed array (``master``, then each optimizer state), every unit's host view."""
        views: dict[str, dict[str, torch.Tensor]] = {"master": {}}
        views.update({name: {} for name in self.optimizer.state_names})
        for unit in self.model.units:
            views["master"][unit.name] = self.host_params.flat(unit)
            for name, view in self.updates.state_views(unit).items():
                views[name][unit.name] = view
        return views

    def schedule_state(self) -> dict[str, int | bool]:
        """What a bit-identical resume needs besides the checkpoint's arrays: the Adam step counter, the
        run of skipped non-finite steps, and whether the next step defers its host updates (Note
        [Deferred clipped steps]; speculation and deferral round differently)."""
        return {
            "step": self.step_count,
            "nonfinite_streak": self._nonfinite_streak,
            "defer_clipped_updates": self._defer_next,
        }

    def restore_schedule_state(self, state: Mapping[str, int | bool]) -> None:
        """Continue from :meth:`schedule_state` of a saved run (keys it lacks keep a fresh run's values)."""
        self.step_count = int(state.get("step", self.step_count))
        self._nonfinite_streak = int(state.get("nonfinite_streak", 0))
        self._defer_next = bool(state.get("defer_clipped_updates", False))

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
        if loss_tokens == 0:
            raise ValueError("no label tokens in this step's micro-batches (every label is -100)")
        if self._resident_host_current:
            self._release_resident_host()  # the GPU masters move on from here
        self.step_count += 1
        number = self.step_count
        self._micro_batches = len(micro_batches)
        schedule = self._schedule(len(micro_batches))
        self.window.start_step(schedule)
        self._ready_after = self.updates.begin_step()
        self._contributions: dict[str, int] = {unit.name: 0 for unit in self.model.units}
        self._expected = self._expected_contributions(len(micro_batches))
        self._lr = lr
        self._clip = None
        if self.clipping:
            self._clip = ClipStep(self.config.max_grad_norm, self.config.skip_nonfinite, deferred=self._defer_next)
        self._host_squares = {} if self._clip is None and self.config.report_grad_norm else None
        self._last_d2h = None
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        position = 0
        for index, batch in enumerate(batches):
            position = self._micro_batch(index, batch, loss_tokens, loss_sum, schedule, position)
        workers.check()
        total, squares = self._read_loss_and_norms(loss_sum)
        grad_norm: float | None = None
        skipped = False
        if self._clip is not None:
            grad_norm, skipped = self._finish_clipped_step(self._clip, number, squares)
        elif squares is not None:
            if self._checks_norms:
                self._check_resident_norms(number, squares)
            if self._host_squares is not None:
                grad_norm = self._unclipped_norm(squares, self._host_squares)
        tokens = sum(int(batch.input_ids.numel()) for batch in batches)
        return StepResult(
            step=number,
            loss=total / loss_tokens,
            tokens=tokens,
            loss_tokens=loss_tokens,
            lr=lr,
            wall_s=time.perf_counter() - began,
            grad_norm=grad_norm,
            skipped=skipped,
        )

    def unit_times(self) -> dict[str, UnitTimes]:
        """Per-unit phase times collected since the last call (completed device spans only)."""
        return self.timeline.take()

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

    def _expected_contributions(self, micro_batches: int) -> dict[str, int]:
        expected = {unit.name: micro_batches for unit in self.model.units}
        if self.model.head.borrowed:
            expected[self.model.embedding.name] += micro_batches
        return expected

    def _read_loss_and_norms(self, loss_sum: torch.Tensor) -> tuple[float, list[float] | None]:
        """The step's summed loss and every unit's device-side squared gradient norm (Note [Gradient norm
        of every step]), in one read. note: CPU-GPU sync point (once per step, for the reported loss)."""
        if self.norms is None:
            return float(loss_sum), None
        values = torch.cat((loss_sum.reshape(1), self.norms.on_device)).tolist()
        return values[0], values[1:]

    def _micro_batch(
        self,
        mb: int,
        batch: HostMicroBatch,
        loss_tokens: int,
        loss_sum: torch.Tensor,
        schedule: list[Visit],
        position: int,
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
        grad_x = self._head(position, schedule, x, inputs, scale, loss_sum)
        position += 1

        # 3. backward: recompute each block from its stashed input, last to first.
        for index in reversed(range(len(blocks))):
            if index > 0:
                self.stash.prefetch(index - 1)
            grad_x = self._backward_block(position, schedule, index, grad_x, inputs)
            position += 1
        self._backward_embedding(position, schedule, ids, inputs, grad_x)
        return position + 1

    # -- visits ----------------------------------------------------------------------------------------
    def _compute(self, position: int, schedule: list[Visit], fn, *, grad: bool) -> torch.Tensor:
        visit = schedule[position]
        slot = self._acquire(position, schedule, visit.unit)
        params = visit.unit.layout.views(slot.params)
        start = self._mark()
        with torch.set_grad_enabled(grad):
            out = fn(params)
        self._span(visit.unit, visit.phase, start)
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
    ) -> torch.Tensor:
        head, embedding = self.model.head, self.model.embedding
        slot = self._acquire(position, schedule, head)
        params = _leaves(head.layout.views(slot.params))
        borrowed_slot: ParamSlot | None = None
        if head.borrowed:
            borrowed_slot = self._acquire(position, schedule, embedding, pinned={slot.index})
            lender = embedding.layout.views(borrowed_slot.params)
            params.update({mine: lender[theirs].detach().requires_grad_() for mine, theirs in head.borrowed.items()})
        grad_into = self._grads_into_slots(slot, borrowed_slot)
        start = self._mark()
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            loss = head.forward_into(params, x, inputs, grad_into)
            names = list(params)
            grads = torch.autograd.grad(loss * scale, [x, *params.values()], allow_unused=True)
        loss_sum.add_(loss.detach().float())
        self._span(head, "head", start)
        own = {name: g for name, g in zip(names, grads[1:], strict=True) if name not in head.borrowed}
        self._offload(head, slot, own)
        slot.compute_done = self.device.record_event("compute")
        if borrowed_slot is not None:
            lent = {theirs: grads[1 + names.index(mine)] for mine, theirs in head.borrowed.items()}
            self._offload(embedding, borrowed_slot, lent)
            borrowed_slot.compute_done = slot.compute_done
        return grads[0]

    def _backward_block(
        self, position: int, schedule: list[Visit], index: int, grad_out: torch.Tensor, inputs: object
    ) -> torch.Tensor:
        block = self.model.blocks[index]
        slot = self._acquire(position, schedule, block)
        params = _leaves(block.layout.views(slot.params))
        start = self._mark()
        x = self.stash.load(index).detach().requires_grad_()
        with torch.enable_grad():
            y = block.forward(params, x, inputs)
            grads = torch.autograd.grad(y, [x, *params.values()], grad_out, allow_unused=True)
        self._span(block, "backward", start)
        self._offload(block, slot, dict(zip(params, grads[1:], strict=True)))
        done = self.device.record_event("compute")
        slot.compute_done = done
        self.stash.release(index, done)
        return grads[0]

    def _backward_embedding(
        self, position: int, schedule: list[Visit], ids: torch.Tensor, inputs: object, grad_out: torch.Tensor
    ) -> None:
        embedding = self.model.embedding
        slot = self._acquire(position, schedule, embedding)
        params = _leaves(embedding.layout.views(slot.params))
        start = self._mark()
        with torch.enable_grad():
            y = embedding.forward(params, ids, inputs)
            grads = torch.autograd.grad(y, list(params.values()), grad_out, allow_unused=True)
        self._span(embedding, "backward", start)
        self._offload(embedding, slot, dict(zip(params, grads, strict=True)))
        slot.compute_done = self.device.record_event("compute")

    # -- residency -------------------------------------------------------------------------------------
    def _acquire(self, position: int, schedule: list[Visit], unit: Unit, pinned: set[int] | None = None) -> ParamSlot:
        """The slot holding ``unit`` for the visit at ``position``; loads it if needed, then prefetches."""
        window, workers = self.window, self.workers
        window.advance(position)
        pinned = set(pinned or ())
        if unit.name in self.residents:
            self._prefetch(position, schedule, pinned)
            return self.residents.slot(unit.name)
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
            if unit.name in self.residents or self.window.resident(unit) is not None:
                continue
            slot = self.window.slot_for(unit, ahead, pinned)
            if slot is None:
                continue
            self._load(slot, unit)

    def _load(self, slot: ParamSlot, unit: Unit) -> None:
        slot.unit = unit
        slot.loaded = self.workers["h2d"].submit(
            self._h2d_job, unit, slot, self._ready_after[unit.name], slot.compute_done
        )

    def _h2d_job(self, unit: Unit, slot: ParamSlot, ready: Future[None], reuse_after: Event | None) -> Event:
        """h2d thread: wait for the unit's last update, then copy its master into the slot."""
        began = time.perf_counter()
        self.workers.wait(ready, f"the update of {unit.name} before loading it")
        self.timeline.host_span(unit.name, "wait", (time.perf_counter() - began) * 1e3)
        device = self.device
        source = self.host_params.flat(unit)
        target = slot.params[: source.numel()]
        chunk = self.config.transfer_chunk_numel
        with device.stream("h2d"):
            if reuse_after is not None:
                device.wait_event("h2d", reuse_after)
            start = device.record_event("h2d", timing=self.timeline.enabled)
            for offset in range(0, source.numel(), chunk):
                target[offset : offset + chunk].copy_(source[offset : offset + chunk], non_blocking=True)
            end = device.record_event("h2d", timing=self.timeline.enabled)
        self.timeline.device_span(unit.name, "h2d", start, end)
        return end

    # -- timing helpers --------------------------------------------------------------------------------
    def _mark(self) -> Event | None:
        return self.device.record_event("compute", timing=True) if self.timeline.enabled else None

    def _span(self, unit: Unit, phase: str, start: Event | None) -> None:
        if start is not None:
            self.timeline.device_span(unit.name, phase, start, self.device.record_event("compute", timing=True))


def _leaves(views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bind slot views as autograd leaves: gradients flow to them, storage stays the slot's."""
    return {name: view.detach().requires_grad_() for name, view in views.items()}
