"""What the engine accepts as a micro-batch, and what it sends to the device for one.

A micro-batch is a sequence of host tensors, each (B, S) int64: ``(input_ids, labels)``, or ``(input_ids,
labels, position_ids)`` for packed rows (a NamedTuple of those three fields works as it is).

Note [Packed micro-batches]: rows packed with several documents carry position ids that restart at every
document; the model then builds block-diagonal causal masks from them (``SlideModel.prepare_inputs``).
Whether a micro-batch is packed at all is decided here, once, on the host tensor: rows that are plain
``0 .. S-1`` are sent as ``None``, so the model keeps its unpacked path (for HF models: no mask at all,
SDPA's ``is_causal``) and no model ever has to ask the device whether its position ids restart, which
would be a CPU-GPU sync per micro-batch. Position ids that are sent travel to the device like the token
ids (``non_blocking``). Tested by ``test_packed_micro_batches_match_the_reference`` and
``test_plain_position_ids_are_sent_as_none``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["DeviceMicroBatch", "HostMicroBatch", "MicroBatchLike", "split_micro_batch"]

MicroBatchLike = Sequence[torch.Tensor]
"""``(input_ids, labels)`` or ``(input_ids, labels, position_ids)``: host tensors, each (B, S) int64."""


class HostMicroBatch(NamedTuple):
    """A checked micro-batch on the host; ``position_ids`` is None for unpacked rows."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None

    def to_device(self, target: torch.device) -> DeviceMicroBatch:
        """Start the host-to-device copies (``non_blocking``, as every micro-batch input travels)."""
        positions = None
        if self.position_ids is not None:
            positions = self.position_ids.to(target, non_blocking=True)
        return DeviceMicroBatch(
            self.input_ids.to(target, non_blocking=True), self.labels.to(target, non_blocking=True), positions
        )


class DeviceMicroBatch(NamedTuple):
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None


def split_micro_batch(micro_batch: MicroBatchLike, index: int) -> HostMicroBatch:
    """Check one micro-batch (``index`` names it in errors) and drop position ids that are plain
    ``arange`` rows (see Note [Packed micro-batches])."""
    if len(micro_batch) not in (2, 3):
        raise ValueError(
            f"micro-batch {index} has {len(micro_batch)} parts; expected (input_ids, labels) or "
            "(input_ids, labels, position_ids)"
        )
    input_ids, labels = micro_batch[0], micro_batch[1]
    positions = micro_batch[2] if len(micro_batch) == 3 else None
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError(
            f"micro-batch {index}: input_ids and labels must both be (batch, seq); got {tuple(input_ids.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if positions is not None:
        if positions.shape != input_ids.shape or positions.is_floating_point() or positions.is_complex():
            raise ValueError(
                f"micro-batch {index}: position_ids must be integers shaped like input_ids "
                f"{tuple(input_ids.shape)}; got {positions.dtype} {tuple(positions.shape)}"
            )
        if _plain_rows(positions):
            positions = None
    return HostMicroBatch(input_ids, labels, positions)


def _plain_rows(position_ids: torch.Tensor) -> bool:
    """Whether every row is ``0 .. S-1``: one sequence per row, nothing packed. Micro-batches are host
    tensors (the data loader's), so this reads no device memory (on a device tensor it would be a
    CPU-GPU sync)."""
    seq = position_ids.shape[-1]
    plain = torch.arange(seq, dtype=position_ids.dtype, device=position_ids.device)
    return bool((position_ids == plain).all())
