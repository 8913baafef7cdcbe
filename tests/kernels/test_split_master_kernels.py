"""The one-launch split-master codec (slide_kernels/ops/split_master.py) against slide_core.split_master's
torch functions and the fp32 patterns themselves: interpreted on the CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from slide_core import split_master as torch_codec
from slide_kernels._backend import kernels_available
from slide_kernels.ops.split_master import ENCODE_BYTES, TritonSplitCodec, split_decode, split_encode

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not kernels_available("cpu"), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not kernels_available("cuda"), reason="no GPU")]),
]
SIZES = [1, 5, 123, 8 * ENCODE_BYTES - 3, 8 * ENCODE_BYTES + 77]


def _hostile_values(n: int, seed: int) -> torch.Tensor:
    """fp32 values with every case the rule has: midpoints rounding up and down (low half 0x8000 under odd
    and even upper halves), carries into the exponent, signed zeros, subnormals, infinities, NaNs."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
    special = torch.tensor(
        [0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F7FFFFF, 0x7F7FFFFF, 0x00000000, 0x80000000,
         0x00008000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC12345, 0x7F808000, 0x477F8000],
        dtype=torch.int64,
    )  # fmt: skip
    midpoint = torch.rand(n, generator=gen) < 0.3
    bits = torch.where(midpoint, (bits & ~0xFFFF) | 0x8000, bits)
    bits[: min(n, special.numel())] = special[: min(n, special.numel())]
    return (bits & 0xFFFFFFFF).to(torch.uint32).view(torch.int32).view(torch.float32)


def _random_ties(n_bits: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (torch_codec.tie_bytes(n_bits),), generator=gen, dtype=torch.uint8)


def _midpoints(lo: torch.Tensor) -> torch.Tensor:
    return lo == torch_codec.MIDPOINT


def _bits_of(ties: torch.Tensor, first: int, count: int) -> torch.Tensor:
    weights = torch.arange(8, dtype=torch.uint8)
    return ((ties.unsqueeze(1) >> weights) & 1).reshape(-1)[first : first + count].bool()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 3, 8, 13])
def test_encode_then_decode_gives_every_pattern_back(device: str, n: int, offset: int) -> None:
    values = _hostile_values(n, seed=n + offset)
    ties = _random_ties(offset + n + 9, seed=1).to(device)  # the first `offset` bits and the last 9+: neighbours'

    before = ties.cpu().clone()
    hi = torch.full((n,), 7.0, dtype=torch.bfloat16, device=device)  # poisoned: every element must be written
    lo = torch.full((n,), 1234, dtype=torch.int16, device=device)
    split_encode(values.to(device), hi, lo, ties, offset)
    out = torch.full((n,), float("nan"), device=device)
    split_decode(hi, lo, ties, offset, out)

    bits, want = out.cpu().view(torch.int32), values.view(torch.int32)
    finite = ~torch.isnan(values)
    assert torch.equal(bits[finite], want[finite])
    assert torch.isnan(out.cpu()[~finite]).all()
    # hi is torch's round-to-nearest-even cast; a NaN becomes the host kernels' quiet NaN 0x7FC0
    hi_bits = hi.cpu().view(torch.int16)
    assert torch.equal(hi_bits[finite], values[finite].to(torch.bfloat16).view(torch.int16))
    assert (hi_bits[~finite] == 0x7FC0).all()
    assert torch.equal(lo.cpu(), values.view(torch.int16).view(-1, 2)[:, 0])
    # tie bits: set for midpoints; every other bit, inside the range or a neighbour's, kept as it was
    after, inside = ties.cpu(), _midpoints(lo.cpu())
    kept = torch.ones(8 * before.numel(), dtype=torch.bool)
    kept[offset : offset + n] = ~inside
    assert torch.equal(_bits_of(after, 0, kept.numel())[kept], _bits_of(before, 0, kept.numel())[kept])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 5, 16])
def test_decode_is_the_torch_functions(device: str, n: int, offset: int) -> None:
    """Arbitrary planes, tie bits random everywhere: decode reads a tie bit only at a midpoint."""
    gen = torch.Generator().manual_seed(n * 31 + offset)
    hi = torch.randint(-(2**15), 2**15, (n,), generator=gen, dtype=torch.int16)
    lo = torch.randint(-(2**15), 2**15, (n,), generator=gen, dtype=torch.int16)
    lo[torch.rand(n, generator=gen) < 0.3] = torch_codec.MIDPOINT
    ties = _random_ties(offset + n, seed=n)
    want = torch.empty(n)
    torch_codec.decode(hi.view(torch.bfloat16), lo, ties, offset, want)
    out = torch.full((n,), 3.0, device=device)
    split_decode(hi.view(torch.bfloat16).to(device), lo.to(device), ties.to(device), offset, out)
    assert torch.equal(out.cpu().view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_encode_decodes_as_the_torch_encode(device: str) -> None:
    """The torch encode clears the non-midpoint bits of whole bytes and this one keeps them: the planes
    decode to the same values either way, and hi and lo are the same bits."""
    n, offset = 3 * 8 * ENCODE_BYTES + 40, 0
    values = _hostile_values(n, seed=5)
    finite = ~torch.isnan(values)
    values = torch.where(finite, values, torch.zeros_like(values))  # NaN's hi differs by design (0x7FC0)
    ties_torch, ties_ours = _random_ties(n, seed=2), _random_ties(n, seed=2).to(device)
    hi_t, lo_t = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    hi_o, lo_o = hi_t.to(device), lo_t.to(device)
    torch_codec.encode(values, hi_t, lo_t, ties_torch, offset)
    split_encode(values.to(device), hi_o, lo_o, ties_ours, offset)
    assert torch.equal(hi_o.cpu().view(torch.int16), hi_t.view(torch.int16))
    assert torch.equal(lo_o.cpu(), lo_t)
    mid = _midpoints(lo_t)
    assert torch.equal(_bits_of(ties_ours.cpu(), 0, n)[mid], _bits_of(ties_torch, 0, n)[mid])


def test_the_codec_object_and_bad_arguments() -> None:
    codec = TritonSplitCodec()
    assert codec.name == "triton"
    values = _hostile_values(40, seed=9)
    values = torch.where(torch.isnan(values), torch.ones_like(values), values)
    hi, lo, ties = (
        torch.empty(40, dtype=torch.bfloat16),
        torch.empty(40, dtype=torch.int16),
        torch.zeros(6, dtype=torch.uint8),
    )
    codec.encode(values, hi, lo, ties, 2)
    out = torch.empty(40)
    codec.decode(hi, lo, ties, 2, out)
    assert torch.equal(out.view(torch.int32), values.view(torch.int32))
    with pytest.raises(ValueError, match="fp32 values"):
        split_encode(values.double(), hi, lo, ties, 0)
    with pytest.raises(ValueError, match="fp32 out"):
        split_decode(hi, lo, ties, 0, torch.empty(40, dtype=torch.float64))
