"""An exact fp32 master stored as two 16-bit planes and a tie bitmask, so the device reads half the bytes.

Why: with a bf16 compute dtype the engine copies every streamed unit's master to the device on every
step, and the device only keeps its bf16 rounding. Stored as fp32, that copy moves 4 bytes per parameter
over PCIe and casts on the device. Stored split, the bf16 rounding is already a plane of its own:

- ``hi`` (bf16): the fp32 value rounded to nearest-even, bit for bit what ``fp32.to(torch.bfloat16)``
  gives (a NaN gives some quiet NaN), so the host-to-device copy sends it as it is, 2 bytes per parameter;
- ``lo`` (int16): the low 16 bits of the fp32 bit pattern;
- ``ties`` (uint8, one bit per element): for ``lo == 0x8000`` only, whether the rounding went up.

Decoding. Write ``U`` for the fp32 pattern's upper 16 bits and ``L`` for ``lo``. Round-to-nearest-even
on the pattern (sign-magnitude, so it is right for negative values too) gives ``hi = U + r`` with ``r =
1`` iff ``L > 0x8000``, or ``L == 0x8000`` and ``U`` is odd. So ``U = hi - r``: ``r`` follows from ``L``
except at the midpoint ``L == 0x8000``, where an even ``hi`` has two candidates (``hi`` itself and
``hi - 1`` both round to it): 65,537 fp32 values share one ``(hi, L)`` pair there, and 16 low bits alone
cannot tell them apart. The tie bit is that ``r``. It is read and written only for midpoint elements
(about one in 65,536), so it costs no bandwidth; its value elsewhere means nothing and is left as it is.

Bit ``k`` of ``ties`` (byte ``k // 8``, bit ``k % 8``) belongs to element ``k`` of the plane it indexes.
Every unit starts at a multiple of 64 elements (unit.py), so a unit owns whole bytes, and the optimizer's
parallel blocks of :data:`TIE_BLOCK` elements are aligned in this numbering, so no two of them share a
byte. The vectorised torch functions here serve every path but the optimizer's kernel (loaders,
exporters, checkpoints, device-resident copies, ``TorchAdamW``); slide_core/optim/fused_adamw.py decodes
and encodes in registers with the same rule.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import numpy as np
import torch

__all__ = [
    "MIDPOINT",
    "TIE_BLOCK",
    "TORCH_SPLIT_CODEC",
    "SplitCodec",
    "SplitMaster",
    "TorchSplitCodec",
    "decode",
    "encode",
    "kernel_array",
    "tie_bytes",
]

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("the split master reads fp32 patterns as (low, high) int16 pairs: little-endian only")

MIDPOINT = -32768
"""``lo == 0x8000`` read as int16: the only low pattern whose rounding direction the tie bit records."""

TIE_BLOCK = 4096
"""Elements per parallel work item of the optimizer kernel, aligned in the tie numbering (a multiple
of 8, so the items never share a tie byte)."""

_PIECE_NUMEL = 1 << 20
"""Elements decoded or encoded per vectorised piece: bounds the temporaries (about 8 bytes each)."""

_ASSIGN_PIECE_NUMEL = 1 << 22
"""Elements converted to fp32 on the planes' device at a time by :meth:`SplitMaster.assign_`."""


def tie_bytes(numel: int) -> int:
    """Bytes of a tie bitmask for ``numel`` elements."""
    return (numel + 7) // 8


@dataclass(frozen=True)
class SplitMaster:
    """A flat range of a split master: ``hi`` and ``lo`` have its length; element ``j`` of the range has
    bit ``offset + j`` of ``ties``. Slicing gives another range over the same storage, which is what the
    optimizer and clipping hand around where an fp32 master range would be a tensor slice."""

    format: ClassVar[Literal["split"]] = "split"
    hi: torch.Tensor
    lo: torch.Tensor
    ties: torch.Tensor
    offset: int = 0

    def __post_init__(self) -> None:
        if self.hi.dtype != torch.bfloat16 or self.lo.dtype != torch.int16 or self.ties.dtype != torch.uint8:
            raise ValueError(
                f"a split master is bf16 hi, int16 lo and uint8 ties, got {self.hi.dtype}, {self.lo.dtype}, "
                f"{self.ties.dtype}"
            )
        if self.hi.shape != self.lo.shape or self.hi.dim() != 1:
            raise ValueError(
                f"hi and lo must be flat and of one length, got {tuple(self.hi.shape)}, {tuple(self.lo.shape)}"
            )
        if self.offset < 0 or tie_bytes(self.offset + self.hi.numel()) > self.ties.numel():
            raise ValueError(
                f"ties ({self.ties.numel()} bytes) do not cover bits {self.offset}..{self.offset + self.hi.numel()}"
            )

    def numel(self) -> int:
        return self.hi.numel()

    @property
    def device(self) -> torch.device:
        return self.hi.device

    def __getitem__(self, index: slice) -> SplitMaster:
        start, stop, stride = index.indices(self.hi.numel())
        if stride != 1:
            raise ValueError("a split master range takes contiguous slices only")
        stop = max(start, stop)
        return SplitMaster(self.hi[start:stop], self.lo[start:stop], self.ties, self.offset + start)

    def decode(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 values (into ``out`` when given, a new tensor otherwise)."""
        if out is None:
            out = torch.empty(self.numel(), dtype=torch.float32, device=self.device)
        decode(self.hi, self.lo, self.ties, self.offset, out)
        return out

    def encode_(self, values: torch.Tensor) -> None:
        """Store ``values`` (fp32, this range's length) in place."""
        encode(values, self.hi, self.lo, self.ties, self.offset)

    # -- slide_core.master_store.MasterRange -----------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """fp32: the values it holds decode to fp32."""
        return torch.float32

    @property
    def index0(self) -> int:
        """The first element's position in the planes (its tie bit), the hash index of compact state."""
        return self.offset

    def values(self) -> torch.Tensor:
        """The fp32 values, decoded into a new tensor."""
        return self.decode()

    def assign_(self, values: torch.Tensor) -> None:
        """Store ``values`` (this range's length, any float dtype and device), piece by piece."""
        values = values.reshape(-1)
        if values.numel() != self.numel():
            raise ValueError(f"a split master range of {self.numel()} cannot take {values.numel()} values")
        for lo in range(0, values.numel(), _ASSIGN_PIECE_NUMEL):
            hi = min(values.numel(), lo + _ASSIGN_PIECE_NUMEL)
            self[lo:hi].encode_(values[lo:hi].to(device=self.device, dtype=torch.float32))

    @contextlib.contextmanager
    def updating(self, scratch: Callable[[int, torch.device], torch.Tensor]) -> Iterator[torch.Tensor]:
        """The fp32 values decoded into ``scratch(numel, device)``, encoded back when the block ends
        (exact both ways, so an update of them is bit for bit the fp32 master's)."""
        values = self.decode(scratch(self.numel(), self.device))
        yield values
        self.encode_(values)

    def kernel_flags_numel(self) -> int:
        """One scratch byte per element: the numba kernels unpack each block's tie bits into it."""
        return self.numel()

    def kernel_operands(self, flags: np.ndarray) -> tuple[Any, ...]:
        """What the ``*_split`` numba kernels take in place of an fp32 master: ``hi`` and ``lo`` as uint16
        words, the tie bytes, the first tie bit, and ``flags`` (at least :meth:`kernel_flags_numel` bytes)."""
        hi = kernel_array(self.hi.view(torch.int16), "master hi").view(np.uint16)
        lo = kernel_array(self.lo, "master lo").view(np.uint16)
        return hi, lo, kernel_array(self.ties, "master ties"), self.offset, flags[: self.numel()]


def kernel_array(t: torch.Tensor, name: str) -> np.ndarray:
    """``t`` as the numpy array a numba kernel reads or writes in place (a host, contiguous tensor)."""
    if t.device.type != "cpu":
        raise ValueError(f"the numba kernels run on host tensors, got {name} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"the numba kernels need contiguous ranges, {name} is not")
    return t.detach().numpy()


def decode(
    hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, offset: int, out: torch.Tensor, *, sync_free: bool = False
) -> None:
    """``out`` (fp32) = the values the planes hold; element ``j`` reads tie bit ``offset + j``.

    Runs on any device, piece by piece; ``ties`` lives with ``hi``. Every non-NaN fp32 pattern comes back
    bit for bit; a NaN comes back as a NaN. ``sync_free``: always read the tie bits rather than first ask
    whether any element needs them (that question is a device sync on a GPU, which a stream that must not
    block its thread cannot afford; the answer is the same either way).
    """
    n = hi.numel()
    if lo.numel() != n or out.numel() != n or out.dtype != torch.float32:
        raise ValueError(f"decode needs hi, lo and an fp32 out of one length, got {n}, {lo.numel()}, {out.numel()}")
    halves = out.view(torch.int16).view(-1, 2)  # (low, high) int16 halves of each fp32 pattern
    for start in range(0, n, _PIECE_NUMEL):
        stop = min(n, start + _PIECE_NUMEL)
        low = lo[start:stop]
        up = low < 0  # unsigned lo >= 0x8000
        midpoint = low == MIDPOINT
        if sync_free or bool(midpoint.any()):  # note: a device sync on a GPU unless sync_free
            up &= ~midpoint | _read_bits(ties, offset + start, stop - start)
        halves[start:stop, 0].copy_(low)
        torch.sub(hi[start:stop].view(torch.int16), up.to(torch.int16), out=halves[start:stop, 1])


def encode(values: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, offset: int) -> None:
    """Store fp32 ``values`` in the planes: ``hi`` = ``values.to(torch.bfloat16)``, ``lo`` = the low 16
    bits, and for every midpoint element its tie bit (``offset + j``); other bits of the bytes the range
    covers whole are cleared, and bytes it shares with a neighbouring range keep the neighbour's bits."""
    n = values.numel()
    if values.dtype != torch.float32 or hi.numel() != n or lo.numel() != n:
        raise ValueError(f"encode needs fp32 values and planes of one length, got {values.dtype} x {n}")
    halves = values.reshape(-1).view(torch.int16).view(-1, 2)
    for start in range(0, n, _PIECE_NUMEL):
        stop = min(n, start + _PIECE_NUMEL)
        rounded = hi[start:stop]
        rounded.copy_(values[start:stop])  # the cast the device would do: round to nearest-even
        lo[start:stop].copy_(halves[start:stop, 0])
        went_up = (halves[start:stop, 0] == MIDPOINT) & (rounded.view(torch.int16) != halves[start:stop, 1])
        _write_bits(ties, offset + start, went_up)


class SplitCodec(Protocol):
    """Decodes and encodes whole device ranges of a split master, with :func:`decode`'s and :func:`encode`'s
    contract: ``decode`` never syncs the host, and after ``encode`` the midpoint elements' tie bits are
    set (what other bits of the covered bytes hold may differ between codecs: no decode reads them).
    ``name`` says which one runs (logs, benchmarks)."""

    name: str

    def decode(self, hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, offset: int, out: torch.Tensor) -> None:
        """``out`` (fp32) = the values the planes hold; element ``j`` reads tie bit ``offset + j``."""
        ...

    def encode(self, values: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, offset: int) -> None:
        """Store fp32 ``values`` in the planes (tie bit ``offset + j`` for element ``j``)."""
        ...


class TorchSplitCodec:
    """:func:`decode` and :func:`encode`: any device, in pieces of :data:`_PIECE_NUMEL` elements (about
    fifteen launches a piece on a GPU; slide_kernels.ops.split_master does a range in one)."""

    name = "torch"

    def decode(self, hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, offset: int, out: torch.Tensor) -> None:
        decode(hi, lo, ties, offset, out, sync_free=True)

    def encode(self, values: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, offset: int) -> None:
        encode(values, hi, lo, ties, offset)


TORCH_SPLIT_CODEC: SplitCodec = TorchSplitCodec()
"""The codec an optimizer has until one is given (``Optimizer.split_codec``); it holds no state."""


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8, device=device)


def _read_bits(ties: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Bits ``first .. first + count`` of ``ties`` as a bool tensor."""
    lo_byte, hi_byte = first // 8, tie_bytes(first + count)
    bits = (ties[lo_byte:hi_byte].unsqueeze(1) >> _bit_weights(ties.device)) & 1
    skip = first - 8 * lo_byte
    return bits.reshape(-1)[skip : skip + count].bool()


def _write_bits(ties: torch.Tensor, first: int, bits: torch.Tensor) -> None:
    """Set bits ``first .. first + len(bits)`` of ``ties``; the other bits of the edge bytes are kept."""
    count = bits.numel()
    lo_byte, hi_byte = first // 8, tie_bytes(first + count)
    skip = first - 8 * lo_byte
    if skip or (first + count) % 8:
        whole = _read_bits(ties, 8 * lo_byte, 8 * (hi_byte - lo_byte))
        whole[skip : skip + count] = bits
        bits = whole
    packed = (bits.view(-1, 8).to(torch.uint8) << _bit_weights(ties.device)).sum(dim=1, dtype=torch.uint8)
    ties[lo_byte:hi_byte].copy_(packed)
