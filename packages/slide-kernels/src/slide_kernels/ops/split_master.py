"""A split fp32 master (bf16 ``hi``, int16 ``lo``, one tie bit per element) decoded and encoded on the
device in one launch each: the codec of a GPU-streamed unit's staged master.

Why: slide_core.split_master's torch functions work in pieces of 1M elements to bound their
temporaries, some fifteen launches a piece: about 5,000 launches for one 218M-parameter block of
Llama-3.1-8B, issued from the engine's h2d thread (decode) and main thread (encode) for every streamed
unit of every step. On an H200 that host-side launching, not the copies, set the pace of a streamed
step (docs/benchmarks.md, "Where each unit's update runs"). These kernels read each plane once and
write the other side once, with no temporaries: 8 bytes per element each way, well under a
millisecond per block on the device, and one launch on the host.

The rule is slide_core.split_master's, and the host kernels' (``_decode_py``/``_encode_py`` in
slide_core/optim/_adamw_kernels.py): ``hi`` is the fp32 value rounded to nearest-even in integer
arithmetic (a NaN becomes the quiet NaN 0x7FC0, as on the host), ``lo`` its low 16 bits, and the tie bit
of a midpoint element (``lo == 0x8000``) says whether the rounding went up. Encoding writes only the tie
bits of midpoint elements and keeps every other bit as it was, as the host kernel does, so the planes
after a streamed update are the host placement's, bit for bit, tie bytes included.
"""

from __future__ import annotations

import contextlib

import torch

from slide_core import split_master as torch_codec
from slide_kernels._backend import tl, triton, use_triton

__all__ = ["DECODE_BLOCK", "ENCODE_BYTES", "TritonSplitCodec", "split_decode", "split_encode"]

DECODE_BLOCK = 2048
"""Elements per program of the decode."""

ENCODE_BYTES = 256
"""Tie bytes per program of the encode (8 elements each): a program owns whole tie bytes, so no two
programs write one."""


@triton.jit
def _split_decode_kernel(hi_ptr, lo_ptr, ties_ptr, out_ptr, n, offset, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    upper = tl.load(hi_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    low = tl.load(lo_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    bit = offs + offset
    tie = (tl.load(ties_ptr + (bit >> 3), mask=mask, other=0).to(tl.int32) >> (bit & 7).to(tl.int32)) & 1
    went_up = tl.where(low == 0x8000, tie, (low > 0x8000).to(tl.int32))
    pattern = (((upper - went_up) & 0xFFFF).to(tl.uint32) << 16) | low.to(tl.uint32)
    tl.store(out_ptr + offs, pattern.to(tl.float32, bitcast=True), mask=mask)


@triton.jit
def _split_encode_kernel(values_ptr, hi_ptr, lo_ptr, ties_ptr, n, offset, n_bytes, BYTES: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    lane = tl.arange(0, 8)
    element = byte[:, None] * 8 + lane[None, :] - offset  # bit ``offset + j`` is element j's
    inside = (element >= 0) & (element < n)
    bits = tl.load(values_ptr + element, mask=inside, other=0.0).to(tl.uint32, bitcast=True)
    upper = bits >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = tl.where(nan, 0x7FC0, ((bits + 0x7FFF + (upper & 1)) >> 16) & 0xFFFF)
    low = bits & 0xFFFF
    tl.store(hi_ptr + element, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=inside)
    tl.store(lo_ptr + element, low.to(tl.uint16).to(tl.int16, bitcast=True), mask=inside)
    byte_mask = byte < n_bytes
    old = tl.load(ties_ptr + byte, mask=byte_mask, other=0).to(tl.int32)
    old_bit = (old[:, None] >> lane[None, :]) & 1
    went_up = (rounded != upper).to(tl.int32)
    bit = tl.where(inside & (low == 0x8000), went_up, old_bit)
    packed = tl.sum(bit << lane[None, :], axis=1)
    tl.store(ties_ptr + byte, packed.to(tl.uint8), mask=byte_mask)


def _launchable(*tensors: torch.Tensor) -> bool:
    return use_triton(*tensors) and all(t.is_contiguous() and t.device == tensors[0].device for t in tensors)


def split_decode(hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, offset: int, out: torch.Tensor) -> None:
    """``out`` (fp32) = the values the planes hold; element ``j`` reads tie bit ``offset + j`` of ``ties``.
    One launch where Triton runs on these tensors, slide_core.split_master.decode otherwise (which never
    asks the device whether a tie bit is needed: no host sync either way)."""
    n = hi.numel()
    if lo.numel() != n or out.numel() != n or out.dtype != torch.float32:
        raise ValueError(f"decode needs hi, lo and an fp32 out of one length, got {n}, {lo.numel()}, {out.numel()}")
    if not _launchable(hi, lo, ties, out):
        torch_codec.decode(hi, lo, ties, offset, out, sync_free=True)
        return
    if n == 0:
        return
    with torch.cuda.device(hi.device) if hi.is_cuda else contextlib.nullcontext():
        _split_decode_kernel[(triton.cdiv(n, DECODE_BLOCK),)](
            hi.view(torch.int16), lo, ties, out, n, offset, BLOCK=DECODE_BLOCK
        )


def split_encode(values: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, offset: int) -> None:
    """Store fp32 ``values`` in the planes: ``hi`` their bf16 rounding to nearest-even, ``lo`` their low 16
    bits, and for each midpoint element whether the rounding went up (tie bit ``offset + j``); every other
    tie bit is kept. One launch where Triton runs on these tensors, slide_core.split_master.encode
    otherwise (which clears the other bits of the bytes the range covers whole: the same values decode)."""
    n = values.numel()
    if values.dtype != torch.float32 or hi.numel() != n or lo.numel() != n:
        raise ValueError(f"encode needs fp32 values and planes of one length, got {values.dtype} x {n}")
    if not _launchable(values, hi, lo, ties):
        torch_codec.encode(values, hi, lo, ties, offset)
        return
    if n == 0:
        return
    if not 0 <= offset < 8:
        ties, offset = ties[offset // 8 :], offset % 8
    n_bytes = torch_codec.tie_bytes(offset + n)
    if ties.numel() < n_bytes:
        raise ValueError(f"ties ({ties.numel()} bytes) do not cover bits {offset}..{offset + n}")
    with torch.cuda.device(values.device) if values.is_cuda else contextlib.nullcontext():
        _split_encode_kernel[(triton.cdiv(n_bytes, ENCODE_BYTES),)](
            values, hi.view(torch.int16), lo, ties, n, offset, n_bytes, BYTES=ENCODE_BYTES
        )


class TritonSplitCodec:
    """:func:`split_decode` and :func:`split_encode` as a :class:`slide_core.split_master.SplitCodec`, which
    the `slide` commands give the optimizer (``Optimizer.split_codec``) for its device ranges."""

    name = "triton"

    def decode(self, hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, offset: int, out: torch.Tensor) -> None:
        split_decode(hi, lo, ties, offset, out)

    def encode(self, values: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, offset: int) -> None:
        split_encode(values, hi, lo, ties, offset)
