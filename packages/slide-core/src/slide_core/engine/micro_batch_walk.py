"""The walk of one micro-batch through the schedule: forward, head, backward, visit by visit.

A training micro-batch (:meth:`MicroBatchWalk.train`):
1. Forward. Each unit waits for its slot's h2d, prefetches the units after it (slot_loader.py), computes
   without grad, and sends its output (the next block's input) to pinned host memory (activations.py).
2. Head. Loss and the head's gradients come out of one forward-with-grad.
3. Backward, last block to first. Each block prefetches the one before it (params and input activation),
   recomputes with grad and backpropagates.
Every gradient goes to its unit's pipeline (pipeline.py) as soon as it is made.

An evaluation micro-batch (:meth:`MicroBatchWalk.evaluate`, Note [Evaluation between steps] in
evaluation.py) walks the same forward loop, keeping no block input, then the head's loss without grad.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slide_core.device import Device
from slide_core.unit import SlideModel

from .activations import ActivationStash, TierActivationStash
from .context import StepContext
from .micro_batch import HostMicroBatch
from .slot_loader import SlotLoader
from .slots import ParamSlot, Visit
from .timeline import ComputeTimer
from .unit_pipelines import UnitPipelines

__all__ = ["MicroBatchWalk"]


class MicroBatchWalk:
    """Runs micro-batches over ``model``'s units, each visit in the slot ``loader`` gives it."""

    def __init__(
        self,
        model: SlideModel,
        device: Device,
        dtype: torch.dtype,
        loader: SlotLoader,
        pipelines: UnitPipelines,
        stash: ActivationStash | TierActivationStash,
        timer: ComputeTimer,
    ) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.loader, self.pipelines, self.stash, self.timer = loader, pipelines, stash, timer

    def schedule(self, micro_batches: int, *, training: bool) -> list[Visit]:
        """Every visit of ``micro_batches``, in order: forward, head and backward when ``training``, else
        forward and the head's loss (visits of phase ``eval``)."""
        model = self.model
        forward, head = ("forward", "head") if training else ("eval", "eval")
        schedule: list[Visit] = []
        for mb in range(micro_batches):
            schedule.append(Visit(model.embedding, forward, mb))
            schedule.extend(Visit(block, forward, mb) for block in model.blocks)
            schedule.append(Visit(model.head, head, mb))
            if training:
                schedule.extend(Visit(block, "backward", mb) for block in reversed(model.blocks))
                schedule.append(Visit(model.embedding, "backward", mb))
        return schedule

    # -- one micro-batch ---------------------------------------------------------------------------------
    def train(
        self,
        batch: HostMicroBatch,
        loss_tokens: int,
        loss_sum: torch.Tensor,
        schedule: list[Visit],
        position: int,
        ctx: StepContext,
    ) -> int:
        """Forward, head and backward of one micro-batch from ``position``; returns the next position."""
        ids, lab, positions = batch.to_device(self.device.torch_device)
        inputs = self.model.prepare_inputs(ids, lab, self.dtype, position_ids=positions)
        # 1. forward: embedding, then blocks; each block's input slides out to the host.
        x, position = self._forward(ids, inputs, schedule, position, keep_inputs=True)
        # 2. head: loss and its gradients in one pass.
        grad_x = self._head(position, schedule, x, inputs, 1.0 / loss_tokens, loss_sum, ctx)
        position += 1
        # 3. backward: recompute each block from its stashed input, last to first.
        for index in reversed(range(len(self.model.blocks))):
            if index > 0:
                self.stash.prefetch(index - 1)
            grad_x = self._backward_block(position, schedule, index, grad_x, inputs, ctx)
            position += 1
        self._backward_embedding(position, schedule, ids, inputs, grad_x, ctx)
        return position + 1

    def evaluate(
        self, batches: Sequence[HostMicroBatch], loss_sum: torch.Tensor, schedule: list[Visit], position: int
    ) -> int:
        """The forward of a group of micro-batches and their heads' summed losses into ``loss_sum``, without
        grad: each unit is visited once for the whole group (Note [Evaluation by groups] in evaluation.py),
        its slot loaded once, every micro-batch's activation carried through it in order."""
        device = self.device.torch_device
        prepared = []
        for batch in batches:
            ids, labels, positions = batch.to_device(device)
            prepared.append((ids, self.model.prepare_inputs(ids, labels, self.dtype, position_ids=positions)))
        xs = [ids for ids, _ in prepared]
        for _ in range(1 + len(self.model.blocks)):  # the embedding, then every block
            xs = [self._compute(position, schedule, x, inputs) for x, (_, inputs) in zip(xs, prepared, strict=True)]
            position += 1
        for x, (_, inputs) in zip(xs, prepared, strict=True):  # the losses added in the micro-batches' order
            self._evaluate_head(position, schedule, x, inputs, loss_sum)
        return position + 1

    @staticmethod
    def inputs_bytes(inputs: object) -> int:
        """Device bytes of the tensors a micro-batch's side inputs hold (masks, rotary tables, labels), found
        through dicts, sequences, dataclasses and attributes, each tensor counted once."""
        seen: set[int] = set()
        total = 0
        stack: list[tuple[object, int]] = [(inputs, 0)]
        while stack:
            item, depth = stack.pop()
            if isinstance(item, torch.Tensor):
                if id(item) not in seen:
                    seen.add(id(item))
                    total += item.numel() * item.element_size()
                continue
            if depth >= 4 or id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, dict):
                children = list(item.values())
            elif isinstance(item, (list, tuple)):
                children = list(item)
            elif hasattr(item, "__dict__"):
                children = list(vars(item).values())
            else:
                continue
            stack.extend((child, depth + 1) for child in children)
        return total

    def _forward(
        self, ids: torch.Tensor, inputs: object, schedule: list[Visit], position: int, *, keep_inputs: bool
    ) -> tuple[torch.Tensor, int]:
        """Embedding, then every block, without grad; ``keep_inputs``: each block's input goes to the stash
        for the backward's recompute. Returns the last block's output and the head's position."""
        model, device = self.model, self.device
        x = self._compute(position, schedule, ids, inputs)
        position += 1
        for index in range(len(model.blocks)):
            if keep_inputs:
                if index == 0:
                    self.stash.ensure(tuple(x.shape), x.dtype)
                self.stash.save(index, x, device.record_event("compute"))
            x = self._compute(position, schedule, x, inputs)
            position += 1
        return x, position

    # -- visits --------------------------------------------------------------------------------------------
    def _compute(self, position: int, schedule: list[Visit], x: torch.Tensor, inputs: object) -> torch.Tensor:
        """The forward of the visit at ``position`` on ``x`` (token ids for the embedding), without grad."""
        visit = schedule[position]
        slot = self.loader.acquire(position, schedule, visit.unit)
        params = visit.unit.layout.views(slot.params)
        start = self.timer.start()
        with torch.no_grad():
            out = visit.unit.forward(params, x, inputs)
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
        slot = self.loader.acquire(position, schedule, head)
        params = _leaves(head.layout.views(slot.params))
        own_share, lent_share = ctx.contribution(head, mb), ctx.contribution(embedding, mb, share=0)
        lender: ParamSlot | None = None
        if head.borrowed:
            lender = self.loader.acquire(position, schedule, embedding, pinned={slot.index})
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

    def _evaluate_head(
        self, position: int, schedule: list[Visit], x: torch.Tensor, inputs: object, loss_sum: torch.Tensor
    ) -> None:
        """The head's summed loss in no-grad mode (a fused loss then makes no gradients either)."""
        head, embedding = self.model.head, self.model.embedding
        slot = self.loader.acquire(position, schedule, head)
        params = head.layout.views(slot.params)
        lender_slot: ParamSlot | None = None
        if head.borrowed:
            lender_slot = self.loader.acquire(position, schedule, embedding, pinned={slot.index})
            lender = embedding.layout.views(lender_slot.params)
            params.update({mine: lender[theirs] for mine, theirs in head.borrowed.items()})
        start = self.timer.start()
        with torch.no_grad():
            loss_sum.add_(head.forward(params, x, inputs).float())
        self.timer.stop(head.name, "eval", start)
        slot.compute_done = self.device.record_event("compute")
        if lender_slot is not None:
            lender_slot.compute_done = slot.compute_done

    def _backward_block(
        self, position: int, schedule: list[Visit], index: int, grad_out: torch.Tensor, inputs: object, ctx: StepContext
    ) -> torch.Tensor:
        block = self.model.blocks[index]
        slot = self.loader.acquire(position, schedule, block)
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
        slot = self.loader.acquire(position, schedule, embedding)
        params = _leaves(embedding.layout.views(slot.params))
        start = self.timer.start()
        with torch.enable_grad():
            y = embedding.forward(params, ids, inputs)
            grads = torch.autograd.grad(y, list(params.values()), grad_out, allow_unused=True)
        self.timer.stop(embedding.name, "backward", start)
        share = 1 if self.model.head.borrowed else 0  # after the head's share (see ``Engine._begin_step``)
        contribution = ctx.contribution(embedding, schedule[position].micro_batch, share)
        self.pipelines[embedding.name].contribute(
            embedding, slot, dict(zip(params, grads, strict=True)), contribution, ctx
        )
        slot.compute_done = self.device.record_event("compute")


def _leaves(views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bind slot views as autograd leaves: gradients flow to them, storage stays the slot's."""
    return {name: view.detach().requires_grad_() for name, view in views.items()}
