"""What one optimizer step tells every unit pipeline: :class:`StepContext`, made once per step,
:class:`Contribution`, what one gradient of a unit is within the step, and :class:`ClipStrategy`, the
interface of the step's clipping strategy (its implementations are in clip_strategy.py).

A unit gets ``micro_batches`` gradient contributions per step, twice that for an embedding whose matrix the
head borrows (the head's share, then its own, in every micro-batch). Where the sum of several lives (a host
fp32 accumulator, a device one, the slot's own buffer) is the unit's pipeline's business; what each
contribution is, is decided here only (:meth:`Contribution.of`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from slide_core.device import Event
from slide_core.optimizer import Correction
from slide_core.unit import Unit

from .clipping import AppliedRange
from .norms import UnitNorms
from .workers import Workers

__all__ = ["ClipStrategy", "Contribution", "ContributionKind", "Routes", "StepContext", "UnitFinisher"]


class ContributionKind(Enum):
    ONLY = "only"
    """The unit's one gradient of the step: applied as it is."""
    FIRST = "first"
    """The first of several: starts the unit's sum."""
    MIDDLE = "middle"
    """Added to the sum."""
    LAST = "last"
    """Added to the sum, which is then the unit's final gradient of the step."""


@dataclass(frozen=True)
class Contribution:
    """The ``index``-th gradient contribution of a unit in a step (0-based, in the order compute makes
    them); ``index`` also orders the contribution's optimizer jobs after the ones before it."""

    index: int
    kind: ContributionKind

    @staticmethod
    def of(index: int, expected: int) -> Contribution:
        """The ``index``-th of ``expected`` contributions: the one place a contribution's kind is decided."""
        if expected == 1:
            kind = ContributionKind.ONLY
        elif index == 0:
            kind = ContributionKind.FIRST
        else:
            kind = ContributionKind.LAST if index + 1 == expected else ContributionKind.MIDDLE
        return Contribution(index, kind)

    @property
    def starts(self) -> bool:
        """Whether it overwrites whatever the unit's sum held (nothing of this step is in it yet)."""
        return self.kind in (ContributionKind.ONLY, ContributionKind.FIRST)

    @property
    def final(self) -> bool:
        """Whether the unit's final gradient of the step exists once it is in."""
        return self.kind in (ContributionKind.ONLY, ContributionKind.LAST)


@dataclass(frozen=True)
class StepContext:
    """One optimizer step, as every pipeline, transfer job and optimizer job of it sees it.

    Jobs capture it when they are issued, so a job still running when the main thread begins the next step
    reads its own step's values (Note [Update futures] in docs/design/engine.md).
    """

    step: int
    """The 1-based Adam step number of this step."""
    lr: float
    micro_batches: int
    expected: Mapping[str, int]
    """Gradient contributions per unit this step, in the model's unit order."""
    clip: ClipStrategy
    """What becomes of each final gradient: applied as it is, speculatively, or held (clip_strategy.py)."""
    updated: Mapping[str, Future[None]]
    """Each unit's 'updated' future of this step: resolved once its update of the step is final."""
    device_updated: frozenset[str]
    """Units updated on the device this step (resident ones, and streamed ones whose update stands as
    applied): their final gradient and its norm stay there."""
    steps_before: int = 0
    """Adam steps the moments had taken before this run's first step (a run started from another run's
    AdamW state): messages number the step as the run counts it, :attr:`run_step`."""

    @property
    def run_step(self) -> int:
        """This step's number as the run counts it, from 1 (the Adam step less the steps before the run)."""
        return self.step - self.steps_before

    def contribution(self, unit: Unit, micro_batch: int, share: int = 0) -> Contribution:
        """The contribution ``unit`` gets in ``micro_batch``: its ``share``-th of that micro-batch (a tied
        embedding gets two: the head's share 0, then its own 1)."""
        expected = self.expected[unit.name]
        return Contribution.of(micro_batch * (expected // self.micro_batches) + share, expected)

    def summed_on_host(self, name: str) -> bool:
        """Whether the unit's final gradient exists only in a host accumulator (several contributions to a
        host-updated unit): its squared norm is then summed on the host, not on the device."""
        return self.expected[name] > 1 and name not in self.device_updated


class UnitFinisher(Protocol):
    """What the step's decision needs of a unit's pipeline: ``UnitPipeline.finish`` (pipeline.py), which
    every pipeline has. Named here so that the strategy need not import the pipelines, which import this."""

    def finish(self, unit: Unit, ctx: StepContext, correction: Correction) -> None: ...


Routes = Sequence[tuple[Unit, UnitFinisher]]
"""Every unit, in forward order, with the pipeline that owns its gradient."""


class ClipStrategy(ABC):
    """One step's strategy. The base is what every strategy has: the records the host pipelines read at
    the end of a clipped step (empty without clipping)."""

    deferred: bool = False
    """Whether host units' final gradients are held until the step's decision (Note [Deferred clipped
    steps]): a GPU-streamed unit then takes the host's path (streamed_pipeline.py)."""
    releases_at_last_chunk: bool = True
    """Whether a host unit is done with its optimizer state once its last chunk is applied (not when its
    update is held for the step's decision)."""
    skip_nonfinite: bool = False
    """Whether a step whose norm is not finite is taken back: a device update that cannot know yet then
    applies a non-finite gradient as zeros, so that its undo is exact (Note [Speculative non-finite
    guard])."""
    speculates: bool = False
    """Whether final gradients are applied with their unit's own ``c_u`` and corrected at the step's
    decision: a GPU-streamed unit's summed gradient then has its norm summed on the host, as the host
    placement sums it (Note [Streamed accumulation] in streamed_pipeline.py)."""

    def __init__(self, *, checks_norms: bool, host_sq: dict[str, float] | None) -> None:
        self.checks_norms = checks_norms
        """Whether per-unit norms decide something (the non-finite checks, clipping): each final
        contribution's device norm then lands ahead of its chunks and is checked before any is applied."""
        self.host_sq = host_sq
        """Host-summed units' squared final-gradient norms, summed chunk by chunk (None: not wanted)."""
        self.applied: dict[str, list[AppliedRange]] = {}
        """Host units' ranges applied before the decision (speculative), to correct."""
        self.held: dict[str, list[AppliedRange]] = {}
        """Host units' ranges held for the decision (deferred), to apply."""
        self.skipped = False
        """Set when the step was taken back (its non-finite norm), before ``finish`` returns or raises."""

    def _add_square(self, name: str, grad: torch.Tensor) -> None:
        assert self.host_sq is not None
        squared = float(torch.linalg.vector_norm(grad, dtype=torch.float32)) ** 2
        self.host_sq[name] = self.host_sq.get(name, 0.0) + squared

    # -- host pipelines, optimizer thread ---------------------------------------------------------------
    @abstractmethod
    def unit_norm(self, unit: Unit, squared: float, contribution: Contribution, step: int) -> None:
        """The device-computed squared norm of the unit's final contribution, landed before its first
        chunk and checked before any of it is applied (Note [Speculative non-finite guard])."""

    @abstractmethod
    def ranges(
        self, unit: Unit, start: int, end: int, grad: torch.Tensor, *, summed: bool, last_chunk: bool
    ) -> Sequence[AppliedRange]:
        """One landed range of the unit's final gradient (``summed``: a view of its host accumulator):
        which ranges to apply now, each with its coefficient."""

    @abstractmethod
    def unit_updated(self, name: str, updated: Future[None]) -> None:
        """After the unit's last chunk was applied (or held): resolve its 'updated' future, or leave that
        to the step's decision."""

    # -- the resident pipeline, main thread (compute stream) --------------------------------------------
    @abstractmethod
    def device_coefficient(self, norms: UnitNorms | None, unit: Unit, grad: torch.Tensor) -> torch.Tensor | None:
        """The coefficient of a device-resident unit's update, as a 0-dim device tensor; None when its
        update is final as applied (its 'updated' future resolves at once)."""

    def summed_coefficient(self, norms: UnitNorms | None, unit: Unit, squared: torch.Tensor) -> torch.Tensor | None:
        """The coefficient of a GPU-streamed unit's device update of a gradient summed over several
        contributions, as a 0-dim device tensor, from ``squared``: its squared norm formed on the device
        as the host sums it (``UnitNorms.summed_square``), so it is the host placement's ``c_u``. None
        when the step does not speculate (Note [Streamed accumulation] in streamed_pipeline.py)."""
        return None

    def applied_coefficient(self, squared: float) -> float:
        """As a host float, the coefficient :meth:`device_coefficient` gave the device update of a unit
        whose shard has the squared gradient norm ``squared``: what a correction of that update on the
        host is told it applied (a GPU-streamed unit's, streamed_pipeline.py). 1 unless the step
        speculates."""
        return 1.0

    # -- the engine, main thread, end of step -----------------------------------------------------------
    @abstractmethod
    def finish(
        self,
        ctx: StepContext,
        squares: list[float] | None,
        workers: Workers,
        routes: Routes,
        last_d2h: Future[Event] | None,
    ) -> float | None:
        """Decide the step and hand the decision to every unit's pipeline; return the global gradient norm
        (None when not reported). ``squares``: every unit's device-side squared norm, read with the loss."""
