"""The gradient path of one unit: device buffer -> pinned host memory -> optimizer, and the end of a step.

This is the per-unit seam of the schedule (gradients ready -> d2h -> update -> parameters ready): the
part a data-parallel engine would extend with a reduce-scatter before the d2h. It is a mixin of
:class:`~slide_core.engine.engine.Engine`, which owns the state it reads (workers, slots, the ring or
store, the optimizer state, the clipping state).

- ``_offload`` (main thread) writes a unit's gradients into its slot's flat buffer; a device-resident
  unit is updated right there on the compute stream, any other is handed to the d2h thread;
- ``_d2h_job`` (d2h thread) streams the buffer in chunks into the ring (or the clipping store) and
  queues one optimizer job per landed chunk, by next-forward priority (Note [Optimizer priority]);
- ``_update_job`` (optimizer thread) applies a chunk;
- ``_finish_clipped_step`` (main thread) forms the step's global norm and keeps, rescales or takes back
  the speculative updates (Note [Clip rollback ordering] in clipping.py).

Note [Only landed chunks are queued]: the d2h thread waits for each chunk's copy to land before it queues
the chunk for the optimizer. The optimizer thread takes the queued chunk of the lowest next-forward
position (Note [Optimizer priority]); had it been handed chunks still in flight, it would pick the newest
one, which the GPU reaches last, and sit in that chunk's event while landed chunks of earlier units
waited. With the pinned clipping store (no ring to throttle the d2h thread) that left the CPU idle for
the whole backward on the H200: every host update ran after it. A ring chunk is handed over before the
next one is taken, so a ring of one chunk cannot deadlock.
"""

from __future__ import annotations

import itertools
import logging
import math
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from slide_core.device import Event
from slide_core.unit import Unit

from .clipping import ClipStep, Correction, clip_coefficient, correct_resident, resident_step
from .slots import ParamSlot
from .updates import GradChunk
from .workers import EngineError

__all__ = ["GradientPath"]

log = logging.getLogger(__name__)


class GradientPath:
    """Mixin: the gradient methods of :class:`Engine` (see the module docstring)."""

    # -- gradients -------------------------------------------------------------------------------------
    def _offload(self, unit: Unit, slot: ParamSlot, grads: dict[str, torch.Tensor | None]) -> None:
        """Write ``grads`` into the slot's flat gradient buffer and start streaming it to the optimizer.

        Parameters missing from ``grads`` (a tied head's share covers only the borrowed matrix) or
        unused by autograd get zeros, so every contribution covers the whole unit.
        """
        workers, device = self.workers, self.device
        self._wait_grads_free(unit, slot)
        count = self._contributions[unit.name]
        self._contributions[unit.name] = count + 1
        sums_in_slot = self._sums_in_slot(unit)
        adding = sums_in_slot and count > 0
        targets, sources = [], []
        for name, view in unit.layout.views(slot.grads).items():
            grad = grads.get(name)
            if grad is not None:
                if grad.data_ptr() == view.data_ptr() and not adding:
                    continue  # written in place by the unit's forward (see _grads_into_slots)
                targets.append(view)
                sources.append(grad)
            elif not adding:
                view.zero_()
        if targets:
            (torch._foreach_add_ if adding else torch._foreach_copy_)(targets, sources)
        mode = _contribution_mode(count, self._expected[unit.name])
        if unit.name in self.residents:
            # See Note [Resident update ordering] in resident.py.
            start = self._mark()
            if self._clip is not None:
                self._speculate_resident(unit, mode, in_slot=sums_in_slot)
            else:
                self.residents.apply(unit.name, mode, self._lr, self.step_count, in_slot=sums_in_slot)
                if mode in ("step", "add_step"):
                    if self.norms is not None:  # the final gradient, which the optimizer step did not write
                        accum = self.residents.units[unit.name].accum
                        final = accum if mode == "add_step" and not sums_in_slot else slot.grads
                        assert final is not None
                        self.norms.add(unit, final, first=True)
                    self.updates.updated[unit.name].set_result(None)
            self._span(unit, "update", start)
            return
        if self.norms is not None:
            self.norms.add(unit, slot.grads[: unit.layout.numel], first=count == 0)
        computed = device.record_event("compute")
        slot.grads_free = self._last_d2h = workers["d2h"].submit(
            self._d2h_job,
            unit,
            slot.grads,
            computed,
            mode,
            self._lr,
            self.step_count,
            self.updates.updated[unit.name],
            self._clip,
            self._host_squares,
            (self.step_count, 0, self._forward_position[unit.name], count),
        )

    def _wait_grads_free(self, unit: Unit, slot: ParamSlot) -> None:
        """Compute stream: wait until the slot's gradient buffer has been streamed out (its last d2h)."""
        if slot.grads_free is not None:
            event = self.workers.wait(slot.grads_free, f"the gradient buffer of {unit.name}")
            self.device.wait_event("compute", event)

    def _sums_in_slot(self, unit: Unit) -> bool:
        """See Note [Tied gradient in the slot] in resident.py: later contributions add to the first."""
        return unit.name in self.residents and self._micro_batches == 1

    def _grads_into_slots(self, head_slot: ParamSlot, borrowed_slot: ParamSlot | None) -> dict[str, torch.Tensor]:
        """The slot gradient views the head's forward may write into (``Unit.grads_in_forward``): a
        fused loss then puts the head matrix's gradient straight where :meth:`_offload` streams it from,
        with no (vocab, hidden) temporary and no copy. Only for a contribution that is written, not
        added to an earlier one; the buffer is first waited for, as :meth:`_offload` would."""
        head, embedding = self.model.head, self.model.embedding
        into: dict[str, torch.Tensor] = {}
        for name in head.grads_in_forward:
            unit, slot, own_name = head, head_slot, name
            if name in head.borrowed:
                assert borrowed_slot is not None
                unit, slot, own_name = embedding, borrowed_slot, head.borrowed[name]
            if self._sums_in_slot(unit) and self._contributions[unit.name] > 0:
                continue
            self._wait_grads_free(unit, slot)
            into[name] = unit.layout.views(slot.grads)[own_name]
        return into

    def _speculate_resident(self, unit: Unit, mode: str, *, in_slot: bool) -> None:
        """Compute stream: a resident unit's update, speculative with clipping on (see clipping.py).
        ``in_slot``: the contributions are summed in the slot (Note [Tied gradient in the slot])."""
        name, lr, step = unit.name, self._lr, self.step_count
        if in_slot and mode in ("stash", "add"):
            return  # the slot holds the running sum; the last contribution applies it
        if in_slot and mode == "add_step":
            mode = "step"
        if mode in ("stash", "add"):
            self.residents.apply(name, mode, lr, step)
            return
        resident = self.residents.units[name]
        if mode == "add_step":
            self.residents.apply(name, "add", lr, step)
            assert resident.accum is not None
            grad = resident.accum
        else:
            grad = resident.slot.grads
        assert self.norms is not None
        squared = self.norms.add(unit, grad, first=True)
        if self.config.skip_nonfinite:
            # See Note [Speculative non-finite guard] in clipping.py: a zero gradient's update can be undone.
            grad.masked_fill_(~torch.isfinite(squared), 0.0)
        coeff = self.norms.device_coefficient(unit, squared, self.config.max_grad_norm)
        chunk = self.config.transfer_chunk_numel
        resident_step(resident, grad, coeff, self.residents.optimizer, self._resident_scaled, chunk, lr=lr, step=step)

    def _d2h_job(
        self,
        unit: Unit,
        grads: torch.Tensor,
        computed: Event,
        mode: str,
        lr: float,
        step: int,
        updated: Future[None],
        clip: ClipStep | None,
        host_squares: dict[str, float] | None,
        order: tuple[int, ...],
    ) -> Event:
        """d2h thread: stream the unit's gradient in chunks; each landed chunk becomes an optimizer job.

        Chunks go to ring slots, or with clipping on straight to the unit's range of the grad store. On a
        unit's final contribution its squared norm goes first, so it has landed when the first chunk has.
        """
        device, workers, ring, store = self.device, self.workers, self.ring, self.store
        chunks = list(_chunks(unit.layout.numel, self.config.transfer_chunk_numel, unit.layout.decay_numel))
        start = None
        end = computed
        norm_sq: torch.Tensor | None = None
        with device.stream("d2h"):
            device.wait_event("d2h", computed)
            if self._checks_norms and mode in ("step", "add_step"):
                assert self.norms is not None
                norm_sq = self.norms.send(unit)
            if store is not None:
                previous = self._consumed.get(unit.name)  # see Note [Grad store reuse] in grad_ring.py
                if previous is not None:
                    workers.wait(previous, f"the optimizer to take the previous gradient of {unit.name}")
            consumed: Future[None] | None = None
            landing: list[_InFlight] = []
            for number, (lo, hi) in enumerate(chunks):
                index: int | None = None
                if store is not None:
                    target = store.flat(unit)[lo:hi]
                else:
                    assert ring is not None
                    consumed = self._hand_over_landed(landing) or consumed  # they free ring chunks
                    index = workers.get(ring.free, "a free gradient ring chunk")
                    target = ring.chunks[index][: hi - lo]
                if start is None:
                    start = device.record_event("d2h", timing=self.timeline.enabled)
                target.copy_(grads[lo:hi], non_blocking=True)
                end = device.record_event("d2h", timing=self.timeline.enabled)
                last = number == len(chunks) - 1
                first_norm = norm_sq if number == 0 else None
                chunk = GradChunk(unit, lo, hi, mode, last, lr, step, updated, first_norm, clip, host_squares)
                landing.append(_InFlight(chunk, target, index, end, (*order, lo)))
            consumed = self._hand_over_landed(landing) or consumed
            if store is not None and consumed is not None:
                self._consumed[unit.name] = consumed
        if start is not None:
            self.timeline.device_span(unit.name, "d2h", start, end)
        return end

    def _hand_over_landed(self, landing: list[_InFlight]) -> Future[None] | None:
        """d2h thread: wait for each chunk's copy to land, then queue it for the optimizer; return the last
        job's future. See Note [Only landed chunks are queued]."""
        consumed = None
        for job in landing:
            job.landed.synchronize()  # note: CPU-GPU sync point (on the d2h thread, by design)
            consumed = self.workers["optimizer"].submit(
                self._update_job, job.chunk, job.target, job.index, job.landed, priority=job.priority
            )
        landing.clear()
        return consumed

    def _update_job(self, chunk: GradChunk, grad: torch.Tensor, index: int | None, landed: Event) -> None:
        """Optimizer thread: apply one landed chunk, then give its ring slot (if any) back."""
        landed.synchronize()  # note: CPU-GPU sync point (on the optimizer thread, by design)
        try:
            self.updates.apply(chunk, grad)
        finally:
            if index is not None and self.ring is not None:
                self.ring.release(index)

    # -- the end of a step: clipping and non-finite gradients -------------------------------------------
    def _finish_clipped_step(self, clip: ClipStep, number: int, on_device: list[float]) -> tuple[float, bool]:
        """Main thread: form the step's global gradient norm, then keep, rescale or take back every
        speculative update, or queue a deferred step's held ones with the final coefficient. Returns
        ``(norm, skipped)``. ``on_device``: every unit's device-side squared norm, read with the loss.
        See Notes [Clip rollback ordering] and [Deferred clipped steps] in clipping.py."""
        workers, cfg = self.workers, self.config
        host_summed = any(self._summed_on_host(unit) for unit in self.model.units)
        if not host_summed and not clip.deferred:
            early = math.sqrt(math.fsum(self._final_squares(clip, on_device).values()))
            if math.isfinite(early) and clip_coefficient(early, cfg.max_grad_norm) >= 1.0:
                # Nothing to correct: the speculative updates stand, and each unit is released as its own
                # last chunk lands, without waiting for the rest (see Note [Early clipping decision]).
                self._nonfinite_streak = 0
                clip.keep(self.updates.updated, self.residents)
                return early, False
        if self._last_d2h is not None:
            workers.wait(self._last_d2h, "the gradient transfers of the step")
        # After every update job of this step (see Note [Optimizer priority] in workers.py): a deferred
        # step's jobs only hold their chunks, so this waits for little more than the last of them.
        barrier = workers["optimizer"].submit(_barrier, priority=(self.step_count, 1))
        workers.wait(barrier, "the gradient chunks of the step")
        squares = self._final_squares(clip, on_device)
        norm = math.sqrt(math.fsum(squares.values()))
        if clip.nonfinite_unit is not None:
            norm = norm if not math.isfinite(norm) else math.nan
        updated = self.updates.updated
        if not math.isfinite(norm) and cfg.skip_nonfinite:
            self._defer_next = False
            self._correct_all(clip, Correction("undo"), updated, number)
            self.step_count = number - 1
            self._nonfinite_streak += 1
            bad = [name for name in self.residents.units if not math.isfinite(squares[name])]
            where = clip.nonfinite_unit or ", ".join(bad) or "the total (its square overflowed fp32)"
            log.warning("step %d skipped: gradient norm %s (non-finite gradients in %s)", number, norm, where)
            if self._nonfinite_streak >= cfg.max_consecutive_nonfinite:
                for name, future in updated.items():
                    workers.wait(future, f"the rollback of {name}")
                raise EngineError(
                    f"non-finite gradients in {self._nonfinite_streak} consecutive steps (the last, step {number}, "
                    f"in {where}); every one was skipped and the weights are those from before the first. "
                    "Training diverged: lower --lr (or raise --warmup-steps), or check the data"
                )
            return norm, True
        self._nonfinite_streak = 0
        coeff = clip_coefficient(norm, cfg.max_grad_norm)
        clipped = math.isfinite(norm) and coeff < 1.0
        # See Note [Deferred clipped steps]: a step that clipped bets that the next one will too.
        self._defer_next = clipped
        self._correct_all(clip, Correction("rescale", coeff) if clipped else Correction("keep"), updated, number)
        return norm, False

    def _summed_on_host(self, unit: Unit) -> bool:
        """Whether the unit's final gradient exists only on the host (several contributions summed in its
        fp32 accumulator): its squared norm is then summed there, not on the device."""
        return self._expected[unit.name] > 1 and unit.name not in self.residents

    def _final_squares(self, clip: ClipStep, on_device: list[float]) -> dict[str, float]:
        """Each unit's squared final-gradient norm: its device slot (``on_device``, read with the step's
        loss), or ``clip.host_sq`` for a unit summed on the host (complete once the step's updates are)."""
        return {
            unit.name: clip.host_sq.get(unit.name, math.nan) if self._summed_on_host(unit) else value
            for unit, value in zip(self.model.units, on_device, strict=True)
        }

    def _correct_all(self, clip: ClipStep, correction: Correction, updated: dict[str, Future[None]], step: int) -> None:
        """Correct every unit's speculative update, or apply its held one (a deferred step), in forward
        order: the next step loads the embedding first, so its update is released first."""
        for unit in self.model.units:
            name = unit.name
            if correction.kind == "keep" and not clip.held.get(name):
                updated[name].set_result(None)
                continue
            if name in self.residents:
                resident = self.residents.units[name]
                summed_in_accum = self._expected[name] > 1 and not self._sums_in_slot(unit)
                grad = resident.accum if summed_in_accum else resident.slot.grads
                assert grad is not None
                start = self._mark()
                assert self.norms is not None
                applied = self.norms.coefficient(unit)
                correct_resident(resident, grad, applied, self._resident_corrector, correction, lr=self._lr, step=step)
                self._span(unit, "update", start)
                updated[name].set_result(None)
                continue
            held = clip.held.get(name)
            ranges = clip.applied.get(name)
            if held and correction.kind != "undo":
                coeff = correction.coeff if correction.kind == "rescale" else 1.0
                self.workers["optimizer"].submit(
                    self.updates.apply_held, unit, held, coeff, self._lr, step, updated[name], priority=(step, 1)
                )
            elif ranges:
                self.workers["optimizer"].submit(
                    self.updates.correct, unit, ranges, correction, self._lr, step, updated[name], priority=(step, 1)
                )
            else:
                updated[name].set_result(None)

    def _check_resident_norms(self, number: int, on_device: list[float]) -> None:
        """Clipping off: resident units were updated on the device unchecked; stop if they saw NaN/Inf.
        ``on_device``: every unit's device-side squared norm, read with the step's loss."""
        units = self.model.units
        bad = [
            u.name
            for u, value in zip(units, on_device, strict=True)
            if u.name in self.residents and not math.isfinite(value)
        ]
        if bad:
            raise EngineError(
                f"non-finite gradients in {', '.join(bad)} at step {number}; with max_grad_norm = 0 the engine "
                "cannot skip a step exactly, so it stops here. Lower --lr, or set max_grad_norm > 0 to skip "
                "such steps"
            )

    def _unclipped_norm(self, on_device: list[float], host_squares: dict[str, float]) -> float:
        """Clipping off: the step's global gradient norm (Note [Gradient norm of every step]). A unit whose
        final gradient is summed on the host has its squared norm summed by the optimizer thread, which
        this waits for: those units' last updates of the step (a host-side wait, no device sync)."""
        squares = {unit.name: value for unit, value in zip(self.model.units, on_device, strict=True)}
        for unit in self.model.units:
            if self._summed_on_host(unit):
                self.workers.wait(self.updates.updated[unit.name], f"the summed gradient of {unit.name}")
                squares[unit.name] = host_squares[unit.name]
        return math.sqrt(math.fsum(squares.values()))


@dataclass(frozen=True)
class _InFlight:
    """A gradient chunk whose device-to-host copy is issued but not yet known to have landed."""

    chunk: GradChunk
    target: torch.Tensor
    index: int | None
    landed: Event
    priority: tuple[int, ...]


def _contribution_mode(count: int, expected: int) -> str:
    """How the ``count``-th of ``expected`` gradient contributions of a step is applied (GradChunk modes)."""
    if expected == 1:
        return "step"
    if count == 0:
        return "stash"
    return "add_step" if count + 1 == expected else "add"


def _barrier() -> None:
    """An optimizer-thread job that does nothing: when it is done, every job queued before it is."""


def _chunks(numel: int, chunk: int, decay_numel: int):
    """Split ``[0, numel)`` into ring-sized chunks that never straddle the decay boundary."""
    cuts = sorted({0, numel, *((decay_numel,) if 0 < decay_numel < numel else ())})
    for lo, hi in itertools.pairwise(cuts):
        for offset in range(lo, hi, chunk):
            yield offset, min(hi, offset + chunk)
