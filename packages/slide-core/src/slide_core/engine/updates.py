"""The host side of one unit's update: optimizer state, gradient accumulation and 'updated' futures.

Everything here runs on the optimizer thread, except ``begin_step`` (main thread, between steps).

Note [Update futures]: each unit has one future per step that the optimizer thread resolves when the
unit's last gradient chunk of that step has been applied. A host-to-device load of the unit for the next
step waits for the future of the step before it, so a unit is never read while it is being written. With
gradient clipping on, the last chunk's update is only speculative, and the future is resolved after the
step's clipping decision instead (Note [Clip rollback ordering] in clipping.py).
"""

from __future__ import annotations

import itertools
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from slide_core.host_params import HostParameters
from slide_core.optimizer import Optimizer
from slide_core.unit import SlideModel, Unit

from .clipping import AdamWCorrection, AppliedRange, ClipStep, Correction, unit_coefficient
from .state_offload import OffloadedState
from .timeline import Timeline
from .workers import EngineError

__all__ = ["GradChunk", "UnitUpdates"]


@dataclass(frozen=True)
class GradChunk:
    """One landed range ``[start, end)`` of a unit's flat gradient, and what to do with it."""

    unit: Unit
    start: int
    end: int
    mode: str  # "step": apply directly; "stash": start accumulation; "add": accumulate; "add_step"
    last_chunk: bool
    lr: float
    step: int
    updated: Future[None]
    """Resolved after the unit's last chunk of the step; captured when the chunk is issued, because the
    main thread may already have begun the next step (see Note [Update futures])."""
    norm_sq: torch.Tensor | None = None
    """On the first chunk of a unit's final contribution (when the engine checks gradients): the pinned
    squared norm of the unit's gradient, landed before this chunk; checked before anything is applied."""
    clip: ClipStep | None = None
    """Set when clipping is on: the update is speculative (see clipping.py)."""
    host_squares: dict[str, float] | None = None
    """Clipping off, gradient norm reported: where a unit summed on the host adds its final gradient's
    squared norm, chunk by chunk, before its 'updated' future is resolved (Note [Gradient norm of every
    step] in engine.py). Clipping keeps its own (``ClipStep.host_sq``)."""


def _done_future() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


class UnitUpdates:
    """Optimizer state per unit (one fp32 slab per state tensor) and the per-step update futures."""

    def __init__(
        self,
        model: SlideModel,
        host_params: HostParameters,
        optimizer: Optimizer,
        timeline: Timeline,
        corrector: AdamWCorrection | None = None,
        device_resident: frozenset[str] = frozenset(),
        offloaded: OffloadedState | None = None,
    ):
        self.model = model
        self.host_params = host_params
        self.optimizer = optimizer
        self.timeline = timeline
        self.corrector = corrector  # set when clipping is on; used on the optimizer thread only
        # The host ranges of device-resident units are left unwritten (so their pages are never
        # touched and cost no RSS) until a checkpoint needs them; ``host_state_valid`` says which hold
        # real values (a resumed checkpoint makes them all valid).
        self.state_slabs = {name: torch.empty(host_params.numel, dtype=torch.float32) for name in optimizer.state_names}
        self.offloaded = offloaded
        elsewhere = set(device_resident) | (set(offloaded.units) if offloaded is not None else set())
        self.host_state_valid = {unit.name: unit.name not in elsewhere for unit in model.units}
        # The order offloaded units' updates come in, for read-ahead: backward order as gradients land,
        # forward order for a deferred step's updates (Note [Deferred clipped steps] in clipping.py).
        order = [u.name for u in model.units if offloaded is not None and u.name in offloaded]
        self._next_offloaded = dict(itertools.pairwise(reversed(order)))
        self._next_offloaded_forward = dict(itertools.pairwise(order))
        # Zeroed by ``zero_fresh_state`` when the engine starts, not here: the engine first gives back
        # the host pages of device-resident masters, so the two never add up in the peak.
        self._fresh = [unit for unit in model.units if unit.name not in elsewhere]
        self._accum: dict[str, torch.Tensor] = {}
        self.updated: dict[str, Future[None]] = {unit.name: _done_future() for unit in model.units}

    def mark_host_state_valid(self) -> None:
        """Every unit's host state now holds real values (e.g. a checkpoint was loaded into the slabs)."""
        self.host_state_valid = dict.fromkeys(self.host_state_valid, True)
        self._fresh = []

    def drop_host_state(self) -> None:
        """Free the host optimizer state (the run is over and will not be checkpointed again)."""
        self.state_slabs = {name: torch.empty(0, dtype=torch.float32) for name in self.state_slabs}
        self._accum.clear()
        self.host_state_valid = dict.fromkeys(self.host_state_valid, False)

    def zero_fresh_state(self) -> None:
        """Zero the host state of the host-updated units of a fresh run (Adam starts from m = v = 0)."""
        for unit in self._fresh:
            for view in self.state_views(unit).values():
                view.zero_()
        self._fresh = []

    @property
    def host_bytes(self) -> int:
        state = sum(t.numel() * t.element_size() for t in self.state_slabs.values())
        return state + sum(t.numel() * t.element_size() for t in self._accum.values())

    def state_views(self, unit: Unit | str) -> dict[str, torch.Tensor]:
        """This unit's flat optimizer state (for checkpoints and tests)."""
        master = self.host_params.flat(unit)
        start = master.data_ptr() - self.host_params.slab.data_ptr()
        start //= master.element_size()
        return {name: slab[start : start + master.numel()] for name, slab in self.state_slabs.items()}

    def _unit_state(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The unit's optimizer state to update in place: host slab views, or staged from the tier."""
        if self.offloaded is not None and unit.name in self.offloaded:
            return self.offloaded.acquire(unit.name)
        return self.state_views(unit)

    def begin_step(self) -> dict[str, Future[None]]:
        """Hand out fresh futures for this step; return the previous step's (what loads must wait for)."""
        previous = self.updated
        self.updated = {unit.name: Future() for unit in self.model.units}
        return previous

    def apply(self, chunk: GradChunk, grad: torch.Tensor) -> None:
        """Apply one landed gradient chunk (optimizer thread)."""
        began = time.perf_counter()
        unit, start, end, clip = chunk.unit, chunk.start, chunk.end, chunk.clip
        if chunk.norm_sq is not None:
            self._first_chunk(chunk, float(chunk.norm_sq))
        if chunk.mode == "step":
            if clip is None:
                self._step(unit, start, end, grad, chunk.lr, chunk.step)
            else:
                self._speculate(chunk, start, end, grad, clip.coeffs.get(unit.name, 1.0))
        else:
            accum = self._accum_for(unit)[start:end]
            if chunk.mode == "stash":
                accum.copy_(grad)
            else:
                accum.add_(grad)
                if chunk.mode == "add_step":
                    if clip is None:
                        if chunk.host_squares is not None:
                            squared = float(torch.linalg.vector_norm(accum, dtype=torch.float32)) ** 2
                            chunk.host_squares[unit.name] = chunk.host_squares.get(unit.name, 0.0) + squared
                        self._step(unit, start, end, accum, chunk.lr, chunk.step)
                    else:
                        self._speculate_accumulated(chunk, accum)
        self.timeline.host_span(unit.name, "update", (time.perf_counter() - began) * 1e3)
        final = chunk.last_chunk and chunk.mode in ("step", "add_step")
        if final and not (clip is not None and clip.deferred):
            self._release_offloaded(unit, self._next_offloaded)
        if final and clip is None:
            chunk.updated.set_result(None)
        elif final and not clip.deferred:  # a deferred unit is released by its update (apply_held)
            clip.finish(unit.name, chunk.updated)  # see Note [Early clipping decision] in clipping.py

    def _first_chunk(self, chunk: GradChunk, norm_sq: float) -> None:
        """Check the unit's device-computed squared norm before anything of it is applied (see Note
        [Speculative non-finite guard] in clipping.py); with clipping, derive the unit's ``c_u``."""
        clip = chunk.clip
        if not math.isfinite(norm_sq):
            if clip is None:
                raise EngineError(
                    f"non-finite gradients in {chunk.unit.name} at step {chunk.step} (squared norm {norm_sq}); "
                    "with max_grad_norm = 0 the engine cannot skip a step exactly, so it stops here. Lower "
                    "--lr, or set max_grad_norm > 0 to skip such steps"
                )
            clip.mark_nonfinite(chunk.unit.name)
        elif clip is not None and chunk.mode == "step":
            clip.coeffs[chunk.unit.name] = unit_coefficient(norm_sq, clip.max_norm)

    def _speculate_accumulated(self, chunk: GradChunk, accum: torch.Tensor) -> None:
        """Sum the squared norm of the unit's final gradient as its chunks are summed; apply the whole unit
        once its last chunk is in, with its ``c_u`` (see clipping.py)."""
        clip, unit = chunk.clip, chunk.unit
        assert clip is not None
        clip.add_sq(unit.name, float(torch.linalg.vector_norm(accum, dtype=torch.float32)) ** 2)
        clip.pending.setdefault(unit.name, []).append((chunk.start, chunk.end))
        if not chunk.last_chunk:
            return
        squared = clip.host_sq[unit.name]
        ranges = clip.pending.pop(unit.name)
        coeff = 1.0
        if math.isfinite(squared):
            coeff = unit_coefficient(squared, clip.max_norm)
        else:
            clip.mark_nonfinite(unit.name)
        whole = self._accum_for(unit)
        for lo, hi in ranges:
            self._speculate(chunk, lo, hi, whole[lo:hi], coeff)

    def _speculate(self, chunk: GradChunk, start: int, end: int, grad: torch.Tensor, coeff: float) -> None:
        """Apply ``coeff * grad`` to ``[start, end)`` and remember it for the step's correction.

        The optimizer scales (``grad_scale``), so a bf16 grad-store range is read once, as bf16, by a fused
        optimizer; its fp32 product is the one the correction forms again (``scale_into``, ``fused_correct``).
        """
        clip, unit = chunk.clip, chunk.unit
        assert clip is not None
        if clip.halted:
            return
        applied = AppliedRange(start, end, grad, end <= unit.layout.decay_numel, coeff)
        if clip.deferred:  # see Note [Deferred clipped steps] in clipping.py
            clip.hold(unit.name, applied)
            return
        self._step(unit, start, end, grad, chunk.lr, chunk.step, grad_scale=coeff)
        clip.record(unit.name, applied)

    def apply_held(
        self, unit: Unit, held: list[AppliedRange], coeff: float, lr: float, step: int, updated: Future[None]
    ) -> None:
        """Optimizer thread: a deferred step's update of ``unit``, every held range scaled by the step's
        final clipping coefficient; then release the unit's next load (Note [Deferred clipped steps])."""
        began = time.perf_counter()
        for applied in held:
            self._step(unit, applied.start, applied.end, applied.grad, lr, step, grad_scale=coeff)
        self._release_offloaded(unit, self._next_offloaded_forward)
        self.timeline.host_span(unit.name, "update", (time.perf_counter() - began) * 1e3)
        updated.set_result(None)

    def _release_offloaded(self, unit: Unit, next_of: dict[str, str]) -> None:
        """After a unit's update: write its offloaded state back and read ahead the next one's."""
        if self.offloaded is None or unit.name not in self.offloaded:
            return
        self.offloaded.release(unit.name)  # see Note [Staging reuse ordering] in state_offload.py
        following = next_of.get(unit.name)
        if following is not None:
            self.offloaded.prefetch(following)

    def correct(
        self,
        unit: Unit,
        ranges: list[AppliedRange],
        correction: Correction,
        lr: float,
        step: int,
        updated: Future[None],
    ) -> None:
        """Optimizer thread: correct the unit's speculative update, then release its next load."""
        assert self.corrector is not None
        began = time.perf_counter()
        master = self.host_params.flat(unit)
        states = self._unit_state(unit)
        for applied in ranges:
            lo, hi = applied.start, applied.end
            state = {name: view[lo:hi] for name, view in states.items()}
            self.corrector.apply(
                correction, master[lo:hi], applied.grad, applied.coeff, state, lr=lr, step=step, decay=applied.decay
            )
        if self.offloaded is not None and unit.name in self.offloaded:
            self.offloaded.release(unit.name)
        self.timeline.host_span(unit.name, "update", (time.perf_counter() - began) * 1e3)
        updated.set_result(None)

    def _step(
        self, unit: Unit, start: int, end: int, grad: torch.Tensor, lr: float, step: int, *, grad_scale: float = 1.0
    ) -> None:
        master = self.host_params.flat(unit)[start:end]
        state = {name: view[start:end] for name, view in self._unit_state(unit).items()}
        decay = end <= unit.layout.decay_numel
        if grad_scale == 1.0:  # the keyword only where it matters: optimizer plugins written before it still work
            self.optimizer.step(master, grad, state, lr=lr, step=step, decay=decay)
        else:
            self.optimizer.step(master, grad, state, lr=lr, step=step, decay=decay, grad_scale=grad_scale)

    def _accum_for(self, unit: Unit) -> torch.Tensor:
        # Allocated on first use only: with no accumulation and no tied weights, none is ever needed.
        accum = self._accum.get(unit.name)
        if accum is None:
            accum = torch.empty(unit.layout.numel, dtype=torch.float32)
            self._accum[unit.name] = accum
        return accum
