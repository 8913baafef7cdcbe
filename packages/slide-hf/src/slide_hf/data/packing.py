"""Documents into fixed-length rows: whole documents side by side, position ids restarting at each one.

Placement is best-fit decreasing over a window of documents (about ``window_tokens`` tokens at a time, so
memory stays bounded on any dataset): longest first, each into the open row with the least room that still
holds it, a new row when none does. It is deterministic (ties keep the source order), never splits a
document (:mod:`slide_hf.data.encode` already cut those longer than a row), and leaves little padding: only
the last few rows of each window are partly empty. Rows then follow the source order of their first
document, so ``--no-shuffle`` reads a file in (nearly) its own order.

Row layout, as HF's packed-sequence masking reads it: ``position_ids`` count 0, 1, ... within each document
and restart at the next, which is how attention becomes block-diagonal (``find_packed_sequence_indices``
starts a segment wherever a position does not follow the previous by one). The padding tail (pad id,
label ``IGNORE``) *continues* the last document's positions: padding then belongs to the last segment,
where it attends only backwards and nothing attends to it, and a row holding a single document keeps
``position_ids == arange(seq_len)``, which HF recognises as unpacked and masks with plain causal attention.

Without packing, each document gets a row of its own, padded the same way.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from slide_hf.data.encode import Document
from slide_hf.data.options import IGNORE

__all__ = ["Packer", "Rows"]


@dataclass(frozen=True)
class Rows:
    """A block of rows, each array (rows, seq_len) int32, and how many documents and tokens they hold."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    documents: int
    tokens: int  # real (non-padding) tokens


class Packer:
    """Packs (or, with ``packing=False``, pads) documents into blocks of rows; push (:meth:`add`) or pull (:meth:`rows`)."""

    def __init__(self, seq_len: int, pad_id: int, *, packing: bool, window_tokens: int = 1 << 21) -> None:
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.packing = packing
        self.window_tokens = max(window_tokens, seq_len)
        self._window: list[Document] = []
        self._tokens = 0

    def rows(self, documents: Iterable[Document]) -> Iterator[Rows]:
        """Every block of rows for ``documents``, in order."""
        for document in documents:
            block = self.add(document)
            if block is not None:
                yield block
        block = self.finish()
        if block is not None:
            yield block

    def add(self, document: Document) -> Rows | None:
        """Take one document; a block of rows comes back whenever a window is full."""
        if len(document.input_ids) > self.seq_len:
            raise ValueError(f"a document of {len(document.input_ids)} tokens exceeds the row of {self.seq_len}")
        self._window.append(document)
        self._tokens += len(document.input_ids)
        return self.finish() if self._tokens >= self.window_tokens else None

    def finish(self) -> Rows | None:
        """The rows of the documents taken since the last block (None if there are none)."""
        if not self._window:
            return None
        block = self._block(self._window)
        self._window, self._tokens = [], 0
        return block

    def _block(self, window: list[Document]) -> Rows:
        bins = self._place(window) if self.packing else [[index] for index in range(len(window))]
        shape = (len(bins), self.seq_len)
        input_ids = np.full(shape, self.pad_id, dtype=np.int32)
        labels = np.full(shape, IGNORE, dtype=np.int32)
        position_ids = np.empty(shape, dtype=np.int32)
        for row, members in enumerate(bins):
            cursor = 0
            for index in members:
                document = window[index]
                length = len(document.input_ids)
                input_ids[row, cursor : cursor + length] = document.input_ids
                labels[row, cursor : cursor + length] = document.labels
                position_ids[row, cursor : cursor + length] = np.arange(length, dtype=np.int32)
                cursor += length
            last_start = position_ids[row, cursor - 1] + 1 if cursor else 0
            position_ids[row, cursor:] = np.arange(last_start, last_start + self.seq_len - cursor, dtype=np.int32)
        tokens = sum(len(document.input_ids) for document in window)
        return Rows(input_ids, labels, position_ids, len(window), tokens)

    def _place(self, window: list[Document]) -> list[list[int]]:
        """Best-fit decreasing: the document indices of each row."""
        order = sorted(range(len(window)), key=lambda index: (-len(window[index].input_ids), index))
        bins: list[list[int]] = []
        room: list[tuple[int, int]] = []  # (free tokens, bin) of rows that are not full, sorted
        for index in order:
            length = len(window[index].input_ids)
            slot = bisect.bisect_left(room, (length, -1))
            if slot < len(room):
                free, target = room.pop(slot)
            else:
                free, target = self.seq_len, len(bins)
                bins.append([])
            bins[target].append(index)
            if free - length > 0:
                bisect.insort(room, (free - length, target))
        # Rows in source order of their first document, documents in source order within a row: a run
        # with --no-shuffle then reads the data in (nearly) the order of the file.
        return sorted((sorted(members) for members in bins), key=lambda members: members[0])
