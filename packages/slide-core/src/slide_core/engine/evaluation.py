"""Forward-only evaluation through the engine's sliding window.

Note [Evaluation between steps]: :meth:`Evaluation.evaluate` runs embedding, blocks and the head's loss
in no-grad mode through the same slots, prefetching and h2d path as a step's forward. It stashes no
activations, writes no gradient buffer, and leaves the optimizer state, the Adam step counter and the
clipping schedule (skipped-step streak, deferral) as they are; all it changes is what the slots hold,
which the next step forgets anyway (``SlotWindow.start_step``). So a run with an evaluation between two
steps is bit for bit the run without it.

It evaluates the current weights without a global flush: each unit's load waits, on the h2d thread as
in a step, for that unit's latest 'updated' future (Note [Update futures] in docs/design/engine.md). That
future is resolved by the last step's update of the unit, or by its correction or deferred update when
clipping decided after the step (Notes [Clip rollback ordering] and [Deferred clipped steps]), so
pending updates overlap the evaluation's first units. Device-resident units are updated on the compute
stream, which orders their updates before the evaluation's compute. Sync points: those host-side waits
for updates (h2d thread), and one read of the loss sum at the end (a CPU-GPU sync, main thread).
Tested by ``test_evaluate_between_steps_changes_nothing`` and ``test_evaluate_sees_pending_updates``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from slide_core.device import Device
from slide_core.unit import SlideModel

from .micro_batch import MicroBatchLike, split_micro_batch
from .micro_batch_walk import MicroBatchWalk
from .slot_loader import SlotLoader
from .slots import SlotWindow
from .workers import Workers

__all__ = ["EvalResult", "Evaluation"]


@dataclass(frozen=True)
class EvalResult:
    """What one evaluation measured: the summed token loss (fp32 on the device, read once), the tokens
    that carry loss (the divisor a training step would use) and all tokens."""

    loss_sum: float
    loss_tokens: int
    tokens: int

    @property
    def loss(self) -> float:
        """Mean loss per label token (NaN when no token carries loss)."""
        return self.loss_sum / self.loss_tokens if self.loss_tokens else math.nan


class Evaluation:
    """Mixin: the forward-only pass of :class:`~slide_core.engine.engine.Engine` (see the module docstring),
    through the step's own forward loop (:class:`MicroBatchWalk`)."""

    model: SlideModel
    device: Device
    window: SlotWindow
    loader: SlotLoader
    walk: MicroBatchWalk
    updated: dict[str, Future[None]]

    @property
    def workers(self) -> Workers:
        raise NotImplementedError

    def evaluate(self, micro_batches: Sequence[MicroBatchLike]) -> EvalResult:
        """The model's loss over ``micro_batches`` (as :meth:`Engine.step` takes them) at the current
        weights, without training. Usable between any two steps; see Note [Evaluation between steps]."""
        workers = self.workers
        if not micro_batches:
            raise ValueError("an evaluation needs at least one micro-batch")
        batches = [split_micro_batch(micro_batch, index) for index, micro_batch in enumerate(micro_batches)]
        schedule = self.walk.schedule(len(batches), training=False)
        self.window.start_step(schedule)
        self.loader.ready_after = dict(self.updated)  # the latest update of every unit, not a new step's
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        position = 0
        for batch in batches:
            position = self.walk.evaluate(batch, loss_sum, schedule, position)
        workers.check()
        total = float(loss_sum)  # note: CPU-GPU sync point (once per evaluation, for the loss)
        return EvalResult(
            loss_sum=total,
            loss_tokens=sum(self.model.loss_token_count(batch.labels) for batch in batches),
            tokens=sum(int(batch.input_ids.numel()) for batch in batches),
        )
