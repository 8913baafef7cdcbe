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
from dataclasses import dataclass

import torch

from .micro_batch import HostMicroBatch, MicroBatchLike, split_micro_batch
from .slots import ParamSlot, Visit

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
    """Mixin: the forward-only pass of :class:`~slide_core.engine.engine.Engine` (see the module docstring)."""

    def evaluate(self, micro_batches: Sequence[MicroBatchLike]) -> EvalResult:
        """The model's loss over ``micro_batches`` (as :meth:`Engine.step` takes them) at the current
        weights, without training. Usable between any two steps; see Note [Evaluation between steps]."""
        workers = self.workers
        if not micro_batches:
            raise ValueError("an evaluation needs at least one micro-batch")
        batches = [split_micro_batch(micro_batch, index) for index, micro_batch in enumerate(micro_batches)]
        schedule = self._evaluation_schedule(len(batches))
        self.window.start_step(schedule)
        self._ready_after = dict(self.updated)  # the latest update of every unit, not a new step's
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        position = 0
        for batch in batches:
            position = self._evaluate_micro_batch(batch, loss_sum, schedule, position)
        workers.check()
        total = float(loss_sum)  # note: CPU-GPU sync point (once per evaluation, for the loss)
        return EvalResult(
            loss_sum=total,
            loss_tokens=sum(self.model.loss_token_count(batch.labels) for batch in batches),
            tokens=sum(int(batch.input_ids.numel()) for batch in batches),
        )

    def _evaluation_schedule(self, micro_batches: int) -> list[Visit]:
        model = self.model
        schedule: list[Visit] = []
        for mb in range(micro_batches):
            schedule.append(Visit(model.embedding, "eval", mb))
            schedule.extend(Visit(block, "eval", mb) for block in model.blocks)
            schedule.append(Visit(model.head, "eval", mb))
        return schedule

    def _evaluate_micro_batch(
        self, batch: HostMicroBatch, loss_sum: torch.Tensor, schedule: list[Visit], position: int
    ) -> int:
        model = self.model
        ids, labels, positions = batch.to_device(self.device.torch_device)
        inputs = model.prepare_inputs(ids, labels, self.dtype, position_ids=positions)
        x = self._compute(position, schedule, lambda p: model.embedding.forward(p, ids, inputs), grad=False)
        position += 1
        for block in model.blocks:
            x = self._compute(position, schedule, lambda p, b=block, h=x: b.forward(p, h, inputs), grad=False)
            position += 1
        self._evaluate_head(position, schedule, x, inputs, loss_sum)
        return position + 1

    def _evaluate_head(
        self, position: int, schedule: list[Visit], x: torch.Tensor, inputs: object, loss_sum: torch.Tensor
    ) -> None:
        """The head's summed loss in no-grad mode (a fused loss then makes no gradients either)."""
        head, embedding = self.model.head, self.model.embedding
        slot = self._acquire(position, schedule, head)
        params = head.layout.views(slot.params)
        lender_slot: ParamSlot | None = None
        if head.borrowed:
            lender_slot = self._acquire(position, schedule, embedding, pinned={slot.index})
            lender = embedding.layout.views(lender_slot.params)
            params.update({mine: lender[theirs] for mine, theirs in head.borrowed.items()})
        start = self.timer.start()
        with torch.no_grad():
            loss_sum.add_(head.forward(params, x, inputs).float())
        self.timer.stop(head.name, "eval", start)
        slot.compute_done = self.device.record_event("compute")
        if lender_slot is not None:
            lender_slot.compute_done = slot.compute_done
