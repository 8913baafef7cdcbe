"""How the host holds the fp32 master: one store object per format, one range object per slice of it.

Why: the master's format (an fp32 slab, or the split planes of slide_core/split_master.py) is a choice
made once, when :class:`~slide_core.host_params.HostParameters` is allocated. Everything that touches the
master afterwards (the host-to-device copy, the optimizer, loaders, exporters, checkpoints) asks the
store or a range of it, so no caller tests which format it holds:

- a :class:`MasterStore` (:class:`Fp32MasterStore`, :class:`SplitMasterStore`) owns the planes: which one
  the host-to-device copy reads, which ranges to give back to the OS, and the :class:`MasterRange` of any
  ``[start, end)``;
- a :class:`MasterRange` (:class:`Fp32Master`, :class:`~slide_core.split_master.SplitMaster`) reads its
  fp32 values, stores fp32 values, and lends an optimizer writable fp32 values around an update
  (:meth:`MasterRange.updating`: the range itself when it is fp32, a decoded scratch encoded back when
  it is split), or its planes as the numba kernels take them (:meth:`MasterRange.kernel_operands`).

An optimizer is handed a master range as ``torch.Tensor | SplitMaster`` (a plain fp32 tensor stays the
plugin contract, so an optimizer that never takes a split master works on tensors only); it calls
:func:`as_master_range` once per call to treat both alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, get_args

import numpy as np
import torch

from slide_core.split_master import SplitMaster, kernel_array, tie_bytes

__all__ = [
    "Allocator",
    "Fp32Master",
    "Fp32MasterStore",
    "MasterFormat",
    "MasterRange",
    "MasterStore",
    "Scratch",
    "SplitMasterStore",
    "as_master_range",
    "master_store",
]

MasterFormat = Literal["fp32", "split"]

Allocator = Callable[[int, torch.dtype], torch.Tensor]
"""``(numel, dtype) -> tensor``: where a store's planes live (pageable memory, or pinned)."""

Scratch = Callable[[int, torch.device], torch.Tensor]
"""``(numel, device) -> fp32 tensor of numel``: scratch an optimizer keeps and lends to a range to decode
into (:meth:`MasterRange.updating`); asked only by a range that is not stored in fp32."""


class MasterRange(Protocol):
    """A flat range of a master in its storage format (structural: ``Fp32Master`` and ``SplitMaster``)."""

    @property
    def format(self) -> MasterFormat:
        """The storage format, which picks the numba kernel (``Kernels.step[master.format]``)."""
        ...

    def numel(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the values it holds (fp32 for every master; another only for a misused tensor)."""
        ...

    @property
    def index0(self) -> int:
        """The position of the range's first element in its storage (the hash index of compact state)."""
        ...

    def __getitem__(self, index: slice) -> MasterRange: ...

    def values(self) -> torch.Tensor:
        """The fp32 values: the storage itself where it is fp32 (do not write it), else a decoded copy."""
        ...

    def decode(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the fp32 values (into ``out`` when given)."""
        ...

    def assign_(self, values: torch.Tensor) -> None:
        """Store ``values`` (this range's length, any float dtype, any device)."""
        ...

    def updating(self, scratch: Scratch) -> contextlib.AbstractContextManager[torch.Tensor]:
        """Writable fp32 values for the block's duration, stored back when it ends without an exception."""
        ...

    def kernel_flags_numel(self) -> int:
        """Bytes of per-element scratch :meth:`kernel_operands` needs (the split master's tie flags)."""
        ...

    def kernel_operands(self, flags: np.ndarray) -> tuple[Any, ...]:
        """The range as the numba kernels of its format take it, in place of an fp32 master array."""
        ...


@dataclass(frozen=True)
class Fp32Master:
    """A range of an fp32 master: the tensor itself, with :class:`MasterRange`'s methods.

    ``origin``: the master position of the tensor's storage element 0, so that :attr:`index0` is the
    range's position in the master (the hash index of compact state) also for a copy of a host range in
    another buffer: a GPU-streamed update works on a device copy of the unit and must round its moments
    as the host would (engine/streamed_pipeline.py)."""

    format: ClassVar[MasterFormat] = "fp32"
    tensor: torch.Tensor
    origin: int = 0

    def numel(self) -> int:
        return self.tensor.numel()

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def index0(self) -> int:
        return self.origin + int(self.tensor.storage_offset())

    def __getitem__(self, index: slice) -> Fp32Master:
        return Fp32Master(self.tensor[index], self.origin)

    def values(self) -> torch.Tensor:
        return self.tensor

    def decode(self, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.tensor.clone() if out is None else out.copy_(self.tensor)

    def assign_(self, values: torch.Tensor) -> None:
        self.tensor.copy_(values.reshape(-1))

    @contextlib.contextmanager
    def updating(self, scratch: Scratch) -> Iterator[torch.Tensor]:
        yield self.tensor  # updated in place: no copy, no scratch

    def kernel_flags_numel(self) -> int:
        return 0

    def kernel_operands(self, flags: np.ndarray) -> tuple[Any, ...]:
        if self.tensor.dtype != torch.float32:
            raise ValueError(f"master must be fp32, got {self.tensor.dtype}")
        return (kernel_array(self.tensor, "master"),)


def as_master_range(master: torch.Tensor | MasterRange) -> MasterRange:
    """``master`` as a :class:`MasterRange`: a plain fp32 tensor (what the engine hands an optimizer for an
    fp32 master, and what tests and device-resident units pass) becomes an :class:`Fp32Master`."""
    return Fp32Master(master) if isinstance(master, torch.Tensor) else master


class MasterStore(Protocol):
    """The planes of a whole master (every unit's range, in model order) and the ranges of them."""

    format: ClassVar[MasterFormat]
    planes: dict[str, torch.Tensor]

    @property
    def h2d_plane(self) -> torch.Tensor:
        """The plane the host-to-device copy reads: the fp32 slab (cast on the device) or the bf16 plane."""
        ...

    @property
    def value_planes(self) -> tuple[torch.Tensor, ...]:
        """The planes with one element per parameter (zeroed where alignment pads a unit)."""
        ...

    @property
    def fp32_slab(self) -> torch.Tensor | None:
        """The fp32 slab itself, when the store holds one (the fp32-only views of HostParameters)."""
        ...

    def range(self, start: int, end: int) -> MasterRange: ...

    def stepped(self, start: int, end: int) -> torch.Tensor | SplitMaster:
        """``[start, end)`` as the optimizer is handed it (``Optimizer.step``'s ``master``)."""
        ...

    def page_ranges(self, start: int, end: int) -> list[torch.Tensor]:
        """Every plane's part of ``[start, end)`` (what to give back to the OS while a unit lives elsewhere)."""
        ...


class Fp32MasterStore:
    """One fp32 slab: the host-to-device copy reads 4 bytes per parameter and casts on the device."""

    format: ClassVar[MasterFormat] = "fp32"

    def __init__(self, numel: int, alloc: Allocator) -> None:
        self.planes = {"master": alloc(numel, torch.float32)}

    @property
    def h2d_plane(self) -> torch.Tensor:
        return self.planes["master"]

    @property
    def value_planes(self) -> tuple[torch.Tensor, ...]:
        return (self.planes["master"],)

    @property
    def fp32_slab(self) -> torch.Tensor | None:
        return self.planes["master"]

    def range(self, start: int, end: int) -> Fp32Master:
        return Fp32Master(self.planes["master"][start:end])

    def stepped(self, start: int, end: int) -> torch.Tensor:
        return self.planes["master"][start:end]

    def page_ranges(self, start: int, end: int) -> list[torch.Tensor]:
        return [self.planes["master"][start:end]]


class SplitMasterStore:
    """A bf16 plane, a plane of the low 16 bits and a tie bitmask (slide_core/split_master.py): the bf16
    plane is the compute copy itself, so the host-to-device copy reads 2 bytes per parameter."""

    format: ClassVar[MasterFormat] = "split"

    def __init__(self, numel: int, alloc: Allocator) -> None:
        # Every unit's range starts at a multiple of 64 elements (unit.py), so each owns whole tie bytes.
        self.planes = {
            "hi": alloc(numel, torch.bfloat16),
            "lo": alloc(numel, torch.int16),
            "ties": alloc(tie_bytes(numel), torch.uint8),
        }

    @property
    def h2d_plane(self) -> torch.Tensor:
        return self.planes["hi"]

    @property
    def value_planes(self) -> tuple[torch.Tensor, ...]:
        return (self.planes["hi"], self.planes["lo"])

    @property
    def fp32_slab(self) -> torch.Tensor | None:
        return None

    def range(self, start: int, end: int) -> SplitMaster:
        return SplitMaster(self.planes["hi"][start:end], self.planes["lo"][start:end], self.planes["ties"], start)

    def stepped(self, start: int, end: int) -> SplitMaster:
        return self.range(start, end)

    def page_ranges(self, start: int, end: int) -> list[torch.Tensor]:
        return [*(plane[start:end] for plane in self.value_planes), self.planes["ties"][start // 8 : tie_bytes(end)]]


def master_store(master_format: str, numel: int, alloc: Allocator) -> MasterStore:
    """A store of ``numel`` elements in ``master_format`` (``fp32`` or ``split``), its planes from ``alloc``."""
    if master_format not in get_args(MasterFormat):
        raise ValueError(f"master format must be fp32 or split, got {master_format!r}")
    if master_format == "split":
        return SplitMasterStore(numel, alloc)
    return Fp32MasterStore(numel, alloc)
