"""What one optimizer step tells every unit pipeline: :class:`StepContext`, made once per step, and
:class:`Contribution`, what one gradient of a unit is within the step.

A unit gets ``micro_batches`` gradient contributions per step, twice that for an embedding whose matrix the
head borrows (the head's share, then its own, in every micro-batch). Where the sum of several lives (a host
fp32 accumulator, a device one, the slot's own buffer) is the unit's pipeline's business; what each
contribution is, is decided here only (:meth:`Contribution.of`).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from slide_core.unit import Unit

if TYPE_CHECKING:
    from .clip_strategy import ClipStrategy

__all__ = ["Contribution", "ContributionKind", "StepContext"]


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
    """Units updated on the device (resident): their final gradient and its norm stay there."""

    def contribution(self, unit: Unit, micro_batch: int, share: int = 0) -> Contribution:
        """The contribution ``unit`` gets in ``micro_batch``: its ``share``-th of that micro-batch (a tied
        embedding gets two: the head's share 0, then its own 1)."""
        expected = self.expected[unit.name]
        return Contribution.of(micro_batch * (expected // self.micro_batches) + share, expected)

    def summed_on_host(self, name: str) -> bool:
        """Whether the unit's final gradient exists only in a host accumulator (several contributions to a
        host-updated unit): its squared norm is then summed on the host, not on the device."""
        return self.expected[name] > 1 and name not in self.device_updated
