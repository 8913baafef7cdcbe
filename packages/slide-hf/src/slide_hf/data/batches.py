"""Micro-batches in a seeded order: ``grad_accum`` micro-batches of ``batch_size`` rows per optimizer step.

The order of rows is a permutation drawn from ``seed + epoch``, so a run resumed at (epoch, index) sees
exactly the batches the uninterrupted run would have. Rows are stored as int32 and leave here as int64
:class:`MicroBatch` es, the dtype embeddings and the loss take.

Data parallel (``world_size`` ranks, docs/distributed.md): a step's global batch is ``grad_accum``
micro-batches of ``batch_size x world_size`` rows, taken from the same seeded order on every rank, and
rank ``r`` keeps rows ``[r * batch_size, (r + 1) * batch_size)`` of each. The position counts global rows,
so it is the same on every rank, and N ranks see together exactly the rows one process with
``batch_size x N`` would.

With ``weights`` (one per source of a mixture, ``--data-weights``) an epoch's order comes from
:func:`~slide_hf.data.mixture.mixture_order` instead: still a function of ``seed`` and the epoch, so
``(epoch, index)`` remains the whole position a resume needs. Without weights the sources' rows are one
pool (concatenated), shuffled together.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from slide_hf.data.dataset import Dataset
from slide_hf.data.mixture import mixture_order
from slide_hf.data.options import IGNORE
from slide_hf.errors import UserError
from slide_hf.spelling import option

__all__ = ["Batches", "DataPosition", "MicroBatch", "eval_batches"]


class MicroBatch(NamedTuple):
    """Host tensors, each (batch, seq_len) int64. Labels are HF-aligned (the head shifts them); position ids
    restart at every packed document, which the model turns into block-diagonal attention."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor


def _micro_batch(dataset: Dataset, rows: torch.Tensor | slice) -> MicroBatch:
    return MicroBatch(
        dataset.input_ids[rows].to(torch.int64),
        dataset.labels[rows].to(torch.int64),
        dataset.position_ids[rows].to(torch.int64),
    )


@dataclass
class DataPosition:
    """Where the next step's rows start: the epoch and the index into that epoch's order."""

    epoch: int = 0
    index: int = 0


class Batches:
    """Micro-batches for each optimizer step: ``grad_accum`` micro-batches of ``batch_size`` rows (this
    rank's rows of the step's global batch when ``world_size > 1``, see the module notes)."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        grad_accum: int,
        *,
        shuffle: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        weights: Sequence[float] | None = None,
    ) -> None:
        if weights is not None and len(weights) != len(dataset.parts):
            raise UserError(
                f"{option('data_weights')} gives {len(weights)} weight(s) for {len(dataset.parts)} {option('data')} source(s)"
            )
        if batch_size < 1:
            raise UserError(f"{option('batch_size')} must be positive, got {batch_size}")
        if grad_accum < 1:
            raise UserError(f"{option('grad_accum')} must be positive, got {grad_accum}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        per_step = batch_size * grad_accum * world_size
        if len(dataset) < per_step:
            ranks = f" x {world_size} ranks" if world_size > 1 else ""
            raise UserError(
                f"{dataset.source} yields {len(dataset)} rows; one step needs {per_step} "
                f"({option('batch_size')} {batch_size} x {option('grad_accum')} {grad_accum}{ranks})"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.weights = tuple(weights) if weights is not None else None
        self.position = DataPosition()
        self.steps_per_epoch = len(dataset) // per_step

    def _order(self, epoch: int) -> torch.Tensor:
        if self.weights is not None:
            rows = [part.rows for part in self.dataset.parts]
            return mixture_order(rows, self.weights, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        return torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch))

    def next_step(self) -> list[MicroBatch]:
        """The next step's micro-batches (this rank's rows of them); a partial tail of an epoch is skipped."""
        per_step = self.batch_size * self.grad_accum * self.world_size
        if self.position.index + per_step > len(self.dataset):
            self.position = DataPosition(self.position.epoch + 1, 0)
        order = self._order(self.position.epoch)[self.position.index : self.position.index + per_step]
        self.position = DataPosition(self.position.epoch, self.position.index + per_step)
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return [_micro_batch(self.dataset, chunk[mine]) for chunk in order.split(self.batch_size * self.world_size)]


def eval_batches(dataset: Dataset, batch_size: int, *, rank: int = 0, world_size: int = 1) -> Iterator[MicroBatch]:
    """Every row once, in order, ``batch_size`` rows at a time (the last batch may be smaller).

    Note [Every rank evaluates as many micro-batches]: with ``world_size`` ranks, rank ``r`` takes the
    micro-batches ``r, r + N, ...`` of that order, so the ranks together see each once, as one process
    does. Every load of an evaluation is an all-gather, so the ranks must call the engine's ``evaluate``
    with as many micro-batches in the same groups: a rank with one fewer than rank 0 ends with a filler, a
    copy of the first micro-batch whose labels are all ``IGNORE``, which adds no loss, no label token and
    (under a preference head) no pair. SFT's evaluation and DPO's reference pass both take their
    micro-batches here (``test_eval_batches_of_the_ranks``)."""
    if batch_size < 1:
        raise UserError(f"the evaluation batch size must be positive, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    total = -(-len(dataset) // batch_size)
    for index, start in enumerate(range(0, len(dataset), batch_size)):
        if index % world_size == rank:
            yield _micro_batch(dataset, slice(start, start + batch_size))
    if total and rank >= total % world_size > 0:  # one micro-batch fewer than rank 0
        first = _micro_batch(dataset, slice(0, batch_size))
        yield first._replace(labels=torch.full_like(first.labels, IGNORE))
