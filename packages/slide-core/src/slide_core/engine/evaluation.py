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

Note [Evaluation by groups]: a step loads every sliding unit once per micro-batch because its backward
needs the unit again; an evaluation does not, so it visits each unit once for a group of micro-batches and
carries all of the group's activations through it, in order (``MicroBatchWalk.evaluate``). Each unit's
weights cross PCIe once per group instead of once per micro-batch: at 8B with an fp32 master, 16 x 1,024
tokens a micro-batch and 24 GiB, a forward is 0.41 s of compute against 0.6 s of loads on an H100 host, so
one at a time the pass is bound by the link, by groups by the compute. The group holds, beyond one
micro-batch, as many activations and side inputs (masks, rotary tables; measured on the first micro-batch)
as fit in one block's weights in the compute dtype: memory a training step's backward holds for that
block's gradient and an evaluation never uses, so the evaluation stays within the step's peak. Each
micro-batch meets the same weights through the same operations as one at a time, and the losses are added
in the same order: the result is bit for bit the same (``test_evaluation_by_groups_is_bit_exact``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from slide_core.device import Device
from slide_core.unit import SlideModel

from .micro_batch import HostMicroBatch, MicroBatchLike, split_micro_batch
from .micro_batch_walk import MicroBatchWalk
from .slot_loader import SlotLoader
from .slots import SlotWindow
from .workers import Workers

__all__ = ["MAX_EVAL_GROUP", "EvalResult", "Evaluation", "eval_group_size"]


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
        size = self._group_size(batches)
        groups = [batches[start : start + size] for start in range(0, len(batches), size)]
        schedule = self.walk.schedule(len(groups), training=False)  # one visit per unit and group
        self.window.start_step(schedule)
        self.loader.ready_after = dict(self.updated)  # the latest update of every unit, not a new step's
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        position = 0
        for group in groups:
            position = self.walk.evaluate(group, loss_sum, schedule, position)
        workers.check()
        total = float(loss_sum)  # note: CPU-GPU sync point (once per evaluation, for the loss)
        return EvalResult(
            loss_sum=total,
            loss_tokens=sum(self.model.loss_token_count(batch.labels) for batch in batches),
            tokens=sum(int(batch.input_ids.numel()) for batch in batches),
        )

    def _group_size(self, batches: Sequence[HostMicroBatch]) -> int:
        """Micro-batches evaluated per visit of each unit (Note [Evaluation by groups]): as many as hold
        their activations and side inputs, beyond the first's, within one block's weights in the compute
        dtype, at most ``MAX_EVAL_GROUP``."""
        if len(batches) == 1:
            return 1
        model, device = self.model, self.device.torch_device
        first = batches[0]
        ids, labels, positions = first.to_device(device)
        inputs_bytes = MicroBatchWalk.inputs_bytes(
            model.prepare_inputs(ids, labels, self.walk.dtype, position_ids=positions)
        )
        itemsize = torch.empty((), dtype=self.walk.dtype).element_size()
        width = model.activation_width() or _hidden_width(model)
        per_batch = int(first.input_ids.numel()) * width * itemsize + inputs_bytes
        room = max((block.layout.param_numel for block in model.blocks), default=0) * itemsize
        return min(len(batches), eval_group_size(per_batch, room))


MAX_EVAL_GROUP = 8
"""Micro-batches per group at most: past a few, each unit's load is a small share of its compute already."""


def eval_group_size(per_batch_bytes: int, block_bytes: int) -> int:
    """Micro-batches an evaluation carries through each unit per load (Note [Evaluation by groups]): one,
    and as many more as ``block_bytes`` (the largest block's weights in the compute dtype) holds of
    ``per_batch_bytes`` (one micro-batch's activation and side inputs), at most :data:`MAX_EVAL_GROUP`. The
    planner prices the reference pass with the same rule."""
    return max(1, min(MAX_EVAL_GROUP, 1 + block_bytes // max(per_batch_bytes, 1)))


def _hidden_width(model: SlideModel) -> int:
    """The hidden state's width: the last dimension of the embedding's widest matrix."""
    widths = [spec.shape[-1] for spec in model.embedding.layout if len(spec.shape) == 2]
    return max(widths, default=1)
