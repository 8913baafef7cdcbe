"""Units: the slidable pieces of a model, and the flat layout of their parameters.

A unit holds no storage. The engine owns one flat buffer per unit (fp32 master on the host, a compute-dtype
copy in a GPU cache slot) and binds views of it into the unit's ``forward`` as a name -> tensor mapping.
That explicit binding replaces re-pointing ``param.data`` behind autograd's back.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ParamLayout", "ParamSpec", "SlideModel", "Unit", "UnitRole"]

_ALIGN_NUMEL = 64
"""Every parameter starts at a multiple of 64 elements (128 bytes in bf16), so views stay aligned for
vectorized kernels and cuBLAS."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter's place in its unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def decay(self) -> bool:
        """The HF Trainer convention this project follows: weight decay only on params with >= 2 dims."""
        return len(self.shape) >= 2


class ParamLayout:
    """Flat layout of a unit's parameters: decaying (>= 2-dim) params first, then the rest.

    Putting every decaying parameter in one prefix ``[0, decay_numel)`` lets AdamW run as two flat calls
    (with and without weight decay) instead of one call per tensor.
    """

    def __init__(self, shapes: Sequence[tuple[str, Sequence[int]]]) -> None:
        names = [name for name, _ in shapes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate parameter names in layout: {names}")
        ordered = sorted(shapes, key=lambda item: len(item[1]) < 2)  # stable: decay first
        specs: list[ParamSpec] = []
        offset = 0
        decay_numel = 0
        for name, shape in ordered:
            spec = ParamSpec(name, tuple(int(d) for d in shape), offset)
            if spec.decay:
                decay_numel = offset + spec.numel
            specs.append(spec)
            offset = _align(offset + spec.numel)
        self.specs: tuple[ParamSpec, ...] = tuple(specs)
        self.numel: int = offset
        self.decay_numel: int = _align(decay_numel) if decay_numel else 0
        self._by_name = {spec.name: spec for spec in self.specs}

    def __getitem__(self, name: str) -> ParamSpec:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[ParamSpec]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def param_numel(self) -> int:
        """Parameters without alignment padding."""
        return sum(spec.numel for spec in self.specs)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> shaped view into ``flat`` (which must hold at least ``numel`` elements)."""
        if flat.numel() < self.numel:
            raise ValueError(f"flat buffer of {flat.numel()} elements is smaller than layout ({self.numel})")
        return {spec.name: flat[spec.offset : spec.offset + spec.numel].view(spec.shape) for spec in self.specs}


def _align(numel: int) -> int:
    return (numel + _ALIGN_NUMEL - 1) // _ALIGN_NUMEL * _ALIGN_NUMEL


class UnitRole(enum.Enum):
    EMBEDDING = "embedding"
    BLOCK = "block"
    HEAD = "head"


class Unit(ABC):
    """One slidable piece of a model.

    ``forward`` receives the bound parameters, the unit's input and the micro-batch's side inputs:
    - embedding: token ids (B, S) -> hidden (B, S, H);
    - block: hidden -> hidden;
    - head: hidden -> the *sum* of per-token losses over label tokens (a 0-dim fp32 tensor). The engine
      divides by the token count of the whole optimizer step, so gradient accumulation is exact.

    ``borrowed`` maps a parameter name this unit uses to a parameter of the embedding unit; that is how
    a tied head reads the embedding matrix without owning a copy.
    """

    def __init__(self, name: str, role: UnitRole, layout: ParamLayout) -> None:
        self.name = name
        self.role = role
        self.layout = layout
        self.borrowed: dict[str, str] = {}

    @abstractmethod
    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: Any) -> torch.Tensor:
        """Compute this unit; must not run backward or keep references to ``params`` after returning."""

    @property
    def grads_in_forward(self) -> frozenset[str]:
        """Parameters whose gradient this unit's forward computes itself and can write straight into a
        buffer the engine owns (a fused LM-head loss makes the head matrix's gradient in its forward).

        For these, the engine passes its own gradient buffers to :meth:`forward_into`, which saves a
        parameter-sized temporary and a copy: at a 128K vocabulary the head matrix's gradient is the
        largest tensor of the step after the logits.
        """
        return frozenset()

    def forward_into(
        self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: Any, grad_into: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """``forward``, with the gradients of the parameters in ``grad_into`` (a subset of
        :attr:`grads_in_forward`) written into those buffers, which autograd then returns as the
        parameters' gradients. The buffers' old contents are overwritten."""
        return self.forward(params, x, inputs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.role.value}, numel={self.layout.param_numel})"


class SlideModel(ABC):
    """A model as the engine sees it: an embedding unit, block units and a head unit.

    Adapters (slide-hf) build these from HF configs; tests build small ones by hand.
    """

    embedding: Unit
    blocks: Sequence[Unit]
    head: Unit

    @property
    def units(self) -> list[Unit]:
        """Every unit in forward order."""
        return [self.embedding, *self.blocks, self.head]

    @abstractmethod
    def prepare_inputs(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        dtype: torch.dtype,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> Any:
        """Side inputs for one micro-batch (positions, rotary cos/sin, masks, labels).

        ``input_ids`` and ``labels`` (both (B, S), int64) are already on the compute device; ``dtype`` is
        the compute dtype. Labels are aligned with ``input_ids`` (HF convention: the head shifts them),
        with ``-100`` marking tokens without loss.

        ``position_ids`` ((B, S) int64, on the device) describe packed rows: wherever they do not step by
        +1 a new document begins, and a token attends only to earlier tokens of its own document. None
        means ``0 .. S-1`` in every row (one sequence per row). A model must build its masks from them
        without reading them on the host: the engine passes None for rows that are plain ``arange`` (it
        checks the host tensor, see Note [Packed micro-batches] in slide_core/engine/micro_batch.py), so
        a model given position ids may assume they restart, and reading a device tensor here would cost
        a CPU-GPU sync per micro-batch.
        """

    def loss_token_count(self, labels: torch.Tensor) -> int:
        """Tokens that carry loss in ``labels`` (a host tensor): the engine's divisor for the step.

        The default is the causal-LM shift: position t predicts label t+1.
        """
        return int((labels[..., 1:] != -100).sum())

    def extra_tensors_bytes(self) -> int:
        """Device bytes of state the model keeps outside units (e.g. rotary tables)."""
        return 0

    def activation_width(self) -> int | None:
        """The last dimension of the activation units pass each other, where it is wider than the hidden
        state; None where it is the hidden state.

        The engine stashes, transfers and keeps gradients of this activation for every block, so the
        planner prices it at this width: a model that carries more than the hidden state from unit to unit
        (Gemma 4's per-layer inputs and shared keys and values) costs that much more activation memory.
        """
        return None
