"""What becomes of each unit's final gradient of a step: the step's clipping strategy.

- :class:`NoClipping` (``max_grad_norm = 0``): every final gradient is applied as it is; the strategy only
  checks norms for non-finite values (``skip_nonfinite``) and forms the reported norm.
- :class:`SpeculativeClipping`: every final gradient is applied at once with its unit's own coefficient
  ``c_u`` and corrected at the end of the step through ``Optimizer.correct`` (Notes [Early clipping
  decision] and [Clip rollback ordering] in docs/design/engine.md).
- :class:`DeferredClipping`: host units' final gradients are held until the step's norm is known, then
  applied once with the final coefficient (Note [Deferred clipped steps]); device-resident units still
  speculate.

Their common interface, :class:`ClipStrategy`, lives in context.py next to the :class:`StepContext` that
carries it, so neither module imports the other. :class:`ClipPolicy` picks one per step and keeps what
carries over between steps. The pipelines call the strategy (host pipelines on the optimizer thread:
:meth:`ClipStrategy.unit_norm`, :meth:`ClipStrategy.ranges`, :meth:`ClipStrategy.unit_updated`; the resident
pipeline on the main thread: :meth:`ClipStrategy.device_coefficient`), and the engine ends the step with
:meth:`ClipStrategy.finish`, which hands the decision to every unit's pipeline (``UnitPipeline.finish``).
Nothing here depends on the optimizer's arithmetic: the final coefficient reaches every update through
``grad_scale`` or ``Optimizer.correct``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import torch

from slide_core.device import Event
from slide_core.optimizer import Correction
from slide_core.unit import Unit

from .clipping import AppliedRange, clip_coefficient, unit_coefficient
from .config import EngineConfig
from .context import ClipStrategy, Contribution, ContributionKind, Routes, StepContext
from .norms import UnitNorms
from .workers import EngineError, Workers

__all__ = ["ClipPolicy", "ClipStrategy", "DeferredClipping", "NoClipping", "SpeculativeClipping"]

log = logging.getLogger(__name__)

KEEP = Correction("keep")


class NoClipping(ClipStrategy):
    """``max_grad_norm = 0``: final gradients are applied as they are."""

    def unit_norm(self, unit: Unit, squared: float, contribution: Contribution, step: int) -> None:
        if not math.isfinite(squared):
            raise EngineError(
                f"non-finite gradients in {unit.name} at step {step} (squared norm {squared}); "
                "with max_grad_norm = 0 the engine cannot skip a step exactly, so it stops here. Lower "
                "--lr, or set max_grad_norm > 0 to skip such steps"
            )

    def ranges(
        self, unit: Unit, start: int, end: int, grad: torch.Tensor, *, summed: bool, last_chunk: bool
    ) -> Sequence[AppliedRange]:
        if summed and self.host_sq is not None:
            self._add_square(unit.name, grad)
        return (AppliedRange(start, end, grad, end <= unit.layout.decay_numel, 1.0),)

    def unit_updated(self, name: str, updated: Future[None]) -> None:
        updated.set_result(None)

    def device_coefficient(self, norms: UnitNorms | None, unit: Unit, grad: torch.Tensor) -> torch.Tensor | None:
        return None

    def finish(
        self,
        ctx: StepContext,
        squares: list[float] | None,
        workers: Workers,
        routes: Routes,
        last_d2h: Future[Event] | None,
    ) -> float | None:
        """Device-resident units were updated unchecked: stop if they saw NaN/Inf. Then the reported norm
        (Note [Gradient norm of every step]): a unit summed on the host has its squared norm summed by the
        optimizer thread, which this waits for (a host-side wait, no device sync)."""
        if squares is None:
            return None
        by_name = dict(zip(ctx.expected, squares, strict=True))
        if self.checks_norms:
            bad = [name for name, value in by_name.items() if name in ctx.device_updated and not math.isfinite(value)]
            if bad:
                raise EngineError(
                    f"non-finite gradients in {', '.join(bad)} at step {ctx.run_step}; with max_grad_norm = 0 the "
                    "engine cannot skip a step exactly, so it stops here. Lower --lr, or set max_grad_norm > 0 "
                    "to skip such steps"
                )
        if self.host_sq is None:
            return None
        for name in by_name:
            if ctx.summed_on_host(name):
                workers.wait(ctx.updated[name], f"the summed gradient of {name}")
                by_name[name] = self.host_sq[name]
        return math.sqrt(math.fsum(by_name.values()))


class SpeculativeClipping(ClipStrategy):
    """Apply every final gradient at once with ``c_u``; correct at the end of the step.

    Written by the optimizer thread and read by the main thread after the step's barrier job (Note [Clip
    rollback ordering]), so its records need no lock; only the early decision's handshake (``kept``,
    ``finished``) takes ``lock``.
    """

    speculates = True

    def __init__(self, policy: ClipPolicy) -> None:
        super().__init__(checks_norms=True, host_sq={})
        self.policy = policy
        self.max_norm = policy.max_norm
        self.skip_nonfinite = policy.skip_nonfinite
        self.coeffs: dict[str, float] = {}
        """Units with one contribution: ``c_u``, from the device norm that landed before the first chunk."""
        self.pending: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        """Host-summed units: the summed ranges waiting for the unit's last chunk."""
        self.nonfinite_unit: str | None = None
        """The first unit found with a non-finite gradient (Note [Speculative non-finite guard])."""
        self.kept = False
        """Set (under ``lock``) when the main thread decided that the updates stand."""
        self.finished: dict[str, Future[None]] = {}
        """Host units whose last chunk was applied before that decision, with their 'updated' futures."""
        self.lock = threading.Lock()

    @property
    def halted(self) -> bool:
        """True once nothing more of the step may be applied."""
        return self.skip_nonfinite and self.nonfinite_unit is not None

    def _mark_nonfinite(self, name: str) -> None:
        if self.nonfinite_unit is None:
            self.nonfinite_unit = name

    # -- host pipelines, optimizer thread ---------------------------------------------------------------
    def unit_norm(self, unit: Unit, squared: float, contribution: Contribution, step: int) -> None:
        if not math.isfinite(squared):
            self._mark_nonfinite(unit.name)
        elif contribution.kind is ContributionKind.ONLY:
            self.coeffs[unit.name] = unit_coefficient(squared, self.max_norm)

    def ranges(
        self, unit: Unit, start: int, end: int, grad: torch.Tensor, *, summed: bool, last_chunk: bool
    ) -> Sequence[AppliedRange]:
        """A summed unit sums its final gradient's squared norm as its chunks are summed, and is applied
        whole once its last chunk is in, with its ``c_u``."""
        name = unit.name
        if not summed:
            return self._take(unit, [(start, end, grad)], self.coeffs.get(name, 1.0))
        self._add_square(name, grad)
        self.pending.setdefault(name, []).append((start, end, grad))
        if not last_chunk:
            return ()
        assert self.host_sq is not None
        squared = self.host_sq[name]
        pieces = self.pending.pop(name)
        coeff = 1.0
        if math.isfinite(squared):
            coeff = unit_coefficient(squared, self.max_norm)
        else:
            self._mark_nonfinite(name)
        return self._take(unit, pieces, coeff)

    def _take(self, unit: Unit, pieces: list[tuple[int, int, torch.Tensor]], coeff: float) -> Sequence[AppliedRange]:
        """Apply now, and remember what was applied for the step's correction."""
        if self.halted:
            return ()
        ranges = [AppliedRange(lo, hi, grad, hi <= unit.layout.decay_numel, coeff) for lo, hi, grad in pieces]
        self.applied.setdefault(unit.name, []).extend(ranges)
        return ranges

    def unit_updated(self, name: str, updated: Future[None]) -> None:
        """Release the unit now if the step was already kept, else leave that to the main thread's decision
        (Note [Early clipping decision])."""
        with self.lock:
            if not self.kept:
                self.finished[name] = updated
                return
        updated.set_result(None)

    # -- the resident pipeline, main thread -------------------------------------------------------------
    def device_coefficient(self, norms: UnitNorms | None, unit: Unit, grad: torch.Tensor) -> torch.Tensor | None:
        """``c_u`` on the device. A non-finite gradient is zeroed first, so that its update can be taken
        back (Note [Speculative non-finite guard])."""
        assert norms is not None
        squared = norms.add(unit, grad, first=True)
        if self.skip_nonfinite:
            grad.masked_fill_(~torch.isfinite(squared), 0.0)
        return norms.device_coefficient(unit, squared, self.max_norm)

    def summed_coefficient(self, norms: UnitNorms | None, unit: Unit, squared: torch.Tensor) -> torch.Tensor | None:
        """``c_u`` on the device from the host-summed square (1 where it is not finite: the pipeline then
        applies zeros, Note [Streamed accumulation] in streamed_pipeline.py)."""
        assert norms is not None
        return norms.device_coefficient(unit, squared, self.max_norm)

    def applied_coefficient(self, squared: float) -> float:
        """``c_u`` as :meth:`device_coefficient` formed it (1 for a non-finite norm: the gradient was
        zeroed), the same float32 value (``UnitNorms.device_coefficient``)."""
        return unit_coefficient(squared, self.max_norm) if math.isfinite(squared) else 1.0

    # -- the engine, main thread, end of step -----------------------------------------------------------
    def finish(
        self,
        ctx: StepContext,
        squares: list[float] | None,
        workers: Workers,
        routes: Routes,
        last_d2h: Future[Event] | None,
    ) -> float | None:
        """Form the step's global norm, then keep, rescale or take back every update (Notes [Clip rollback
        ordering] and [Deferred clipped steps])."""
        assert squares is not None
        policy = self.policy
        if not self.deferred and not any(ctx.summed_on_host(name) for name in ctx.expected):
            early = math.sqrt(math.fsum(self._final_squares(ctx, squares).values()))
            if math.isfinite(early) and clip_coefficient(early, self.max_norm) >= 1.0:
                # Nothing to correct: the updates stand, and each host unit is released as its own last
                # chunk lands, without waiting for the rest (Note [Early clipping decision]).
                policy.nonfinite_streak = 0
                self._decide(ctx, routes, KEEP)
                return early
        if last_d2h is not None:
            workers.wait(last_d2h, "the gradient transfers of the step")
        # After every update job of this step (Note [Optimizer priority] in workers.py): a deferred step's
        # jobs only hold their chunks, so this waits for little more than the last of them.
        barrier = workers["optimizer"].submit(_barrier, priority=(ctx.step, 1))
        workers.wait(barrier, "the gradient chunks of the step")
        squares_by = self._final_squares(ctx, squares)
        norm = math.sqrt(math.fsum(squares_by.values()))
        if self.nonfinite_unit is not None:
            norm = norm if not math.isfinite(norm) else math.nan
        if not math.isfinite(norm) and self.skip_nonfinite:
            self._skip(ctx, routes, workers, squares_by, norm)
            return norm
        policy.nonfinite_streak = 0
        coeff = clip_coefficient(norm, self.max_norm)
        clipped = math.isfinite(norm) and coeff < 1.0
        # Note [Deferred clipped steps]: a step that clipped bets that the next one will too.
        policy.defer_next = clipped
        self._decide(ctx, routes, Correction("rescale", coeff) if clipped else KEEP)
        return norm

    def _skip(
        self, ctx: StepContext, routes: Routes, workers: Workers, squares_by: Mapping[str, float], norm: float
    ) -> None:
        """Take every update of the step back; stop after ``max_consecutive_nonfinite`` such steps."""
        policy = self.policy
        policy.defer_next = False
        self.skipped = True
        self._decide(ctx, routes, Correction("undo"))
        policy.nonfinite_streak += 1
        bad = [name for name, value in squares_by.items() if name in ctx.device_updated and not math.isfinite(value)]
        where = self.nonfinite_unit or ", ".join(bad) or "the total (its square overflowed fp32)"
        log.warning("step %d skipped: gradient norm %s (non-finite gradients in %s)", ctx.run_step, norm, where)
        if policy.nonfinite_streak >= policy.max_consecutive:
            for name, future in ctx.updated.items():
                workers.wait(future, f"the rollback of {name}")
            raise EngineError(
                f"non-finite gradients in {policy.nonfinite_streak} consecutive steps (the last, step {ctx.run_step}, "
                f"in {where}); every one was skipped and the weights are those from before the first. "
                "Training diverged: lower --lr (or raise --warmup-steps), or check the data"
            )

    def _decide(self, ctx: StepContext, routes: Routes, correction: Correction) -> None:
        """Hand the decision to every unit's pipeline, in forward order: the next step loads the embedding
        first, so its update is released first."""
        if correction.kind == "keep":
            with self.lock:
                self.kept = True
                done = list(self.finished.values())
            for future in done:
                future.set_result(None)
        for unit, pipeline in routes:
            pipeline.finish(unit, ctx, correction)

    def _final_squares(self, ctx: StepContext, squares: list[float]) -> dict[str, float]:
        """Each unit's squared final-gradient norm: its device slot (read with the step's loss), or
        ``host_sq`` for a unit summed on the host (complete once the step's updates are)."""
        assert self.host_sq is not None
        return {
            name: self.host_sq.get(name, math.nan) if ctx.summed_on_host(name) else value
            for name, value in zip(ctx.expected, squares, strict=True)
        }


class DeferredClipping(SpeculativeClipping):
    """After a step that clipped: host units' final gradients are held, not applied, until the step's norm
    is known (Note [Deferred clipped steps]); device-resident units speculate as before."""

    deferred = True
    releases_at_last_chunk = False

    def _take(self, unit: Unit, pieces: list[tuple[int, int, torch.Tensor]], coeff: float) -> Sequence[AppliedRange]:
        if not self.halted:
            held = self.held.setdefault(unit.name, [])
            held.extend(AppliedRange(lo, hi, grad, hi <= unit.layout.decay_numel, coeff) for lo, hi, grad in pieces)
        return ()

    def unit_updated(self, name: str, updated: Future[None]) -> None:
        """Nothing: the unit is released by its held update, queued with the decision."""


class ClipPolicy:
    """Clipping across steps: the strategy each step gets, and what carries from one step to the next
    (the run of skipped non-finite steps, whether the next step defers). Part of a resume's schedule
    state (``Engine.schedule_state``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.max_norm = config.max_grad_norm
        self.skip_nonfinite = config.skip_nonfinite
        self.max_consecutive = config.max_consecutive_nonfinite
        self.reports_norm = config.report_grad_norm
        self.nonfinite_streak = 0
        self.defer_next = False

    @property
    def clipping(self) -> bool:
        return self.max_norm > 0.0

    def for_step(self) -> ClipStrategy:
        """The strategy of the step about to start."""
        if not self.clipping:
            # Norms that decide something (the non-finite checks), or that are only reported: with
            # skip_nonfinite off, a reported norm never stops the engine.
            return NoClipping(checks_norms=self.skip_nonfinite, host_sq={} if self.reports_norm else None)
        return DeferredClipping(self) if self.defer_next else SpeculativeClipping(self)


def _barrier() -> None:
    """An optimizer-thread job that does nothing: when it is done, every job queued before it is."""
