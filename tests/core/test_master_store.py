"""slide_core/master_store.py: both master stores hold fp32 values exactly, and their ranges answer the same
questions (values, stores, updates, the kernels' operands) without a caller testing the format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slide_core.master_store import Fp32Master, Fp32MasterStore, SplitMasterStore, as_master_range, master_store
from slide_core.split_master import MIDPOINT, SplitMaster

FORMATS = ("fp32", "split")
NUMEL = 64 * 40


def _values(numel: int, seed: int = 0) -> torch.Tensor:
    """fp32 values with every awkward pattern a split master must keep: midpoints (rounding up and down),
    signed zeros, subnormals, infinities, values that round to the next binade."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=g) * 10.0 ** torch.randint(-30, 30, (numel,), generator=g)
    bits = values.view(torch.int32)
    bits[::7] = (bits[::7] & ~0xFFFF) | (MIDPOINT & 0xFFFF)  # exact midpoints of both parities
    values[:8] = torch.tensor([0.0, -0.0, 1e-45, -1e-40, float("inf"), -float("inf"), 3.3895314e38, 1.0])
    return values


def _empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((numel,), 7, dtype=dtype) if dtype != torch.bfloat16 else torch.empty(numel, dtype=dtype)


@pytest.mark.parametrize("master_format", FORMATS)
def test_a_store_round_trips_every_value(master_format: str) -> None:
    store = master_store(master_format, NUMEL, _empty)
    assert store.format == master_format
    values = _values(NUMEL)
    store.range(0, NUMEL).assign_(values)
    assert torch.equal(store.range(0, NUMEL).values().view(torch.int32), values.view(torch.int32))
    piece = store.range(64 * 3, 64 * 9)[100:300]  # a range of a range: elements 292..492
    assert torch.equal(piece.decode().view(torch.int32), values[292:492].view(torch.int32))
    assert piece.numel() == 200 and piece.index0 == 292 and piece.dtype == torch.float32
    out = torch.empty(200)
    assert piece.decode(out) is out


@pytest.mark.parametrize("master_format", FORMATS)
def test_assign_takes_any_dtype_and_updating_stores_back(master_format: str) -> None:
    store = master_store(master_format, NUMEL, _empty)
    store.range(0, NUMEL).assign_(torch.zeros(NUMEL, dtype=torch.float64))
    lent: list[int] = []

    def scratch(numel: int, device: torch.device) -> torch.Tensor:
        lent.append(numel)
        return torch.empty(numel, device=device)

    with store.range(128, 256).updating(scratch) as values:
        values.add_(1.5)
    assert lent == ([] if master_format == "fp32" else [128])  # an fp32 range is updated in place
    got = store.range(0, NUMEL).values()
    assert torch.equal(got[128:256], torch.full((128,), 1.5)) and not got[:128].any() and not got[256:].any()
    with pytest.raises(RuntimeError, match="left as it was"), store.range(0, 64).updating(scratch) as values:
        values.fill_(2.0)
        raise RuntimeError("left as it was")
    assert (store.range(0, 64).values() == 2.0).all() == (master_format == "fp32")  # split: never encoded


def test_the_stores_give_the_h2d_copy_and_the_os_what_each_format_holds() -> None:
    fp32, split = Fp32MasterStore(NUMEL, _empty), SplitMasterStore(NUMEL, _empty)
    assert fp32.h2d_plane.dtype == torch.float32 and split.h2d_plane.dtype == torch.bfloat16
    assert fp32.fp32_slab is fp32.planes["master"] and split.fp32_slab is None
    assert [t.numel() for t in fp32.page_ranges(64, 192)] == [128]
    assert [t.numel() for t in split.page_ranges(64, 192)] == [128, 128, 16]  # hi, lo and their tie bytes
    assert type(fp32.stepped(0, 64)) is torch.Tensor and type(split.stepped(0, 64)) is SplitMaster
    with pytest.raises(ValueError, match="master format must be fp32 or split, got 'bf16'"):
        master_store("bf16", NUMEL, _empty)


@pytest.mark.parametrize("master_format", FORMATS)
def test_kernel_operands_are_the_storage_itself(master_format: str) -> None:
    store = master_store(master_format, NUMEL, _empty)
    store.range(0, NUMEL).assign_(_values(NUMEL, seed=1))
    piece = store.range(64, 64 * 5)
    flags = np.empty(piece.kernel_flags_numel(), dtype=np.uint8)
    operands = piece.kernel_operands(flags)
    if master_format == "fp32":
        assert piece.kernel_flags_numel() == 0 and len(operands) == 1
        operands[0][:] = 4.0  # a view: written in place
    else:
        assert piece.kernel_flags_numel() == piece.numel() and operands[3] == 64 and operands[4] is not None
        assert operands[0].dtype == np.uint16 and operands[1].dtype == np.uint16 and operands[2].dtype == np.uint8
        operands[0][:] = torch.tensor(4.0, dtype=torch.bfloat16).view(torch.int16).item()
        operands[1][:] = 0
    assert (store.range(64, 64 * 5).values() == 4.0).all()


def test_as_master_range_wraps_a_tensor_and_keeps_a_range() -> None:
    tensor = torch.arange(8, dtype=torch.float32)
    wrapped = as_master_range(tensor[2:])
    assert isinstance(wrapped, Fp32Master) and wrapped.values().data_ptr() == tensor[2:].data_ptr()
    assert wrapped.index0 == 2 and wrapped.format == "fp32"
    split = SplitMasterStore(64, _empty).range(0, 64)
    assert as_master_range(split) is split and split.format == "split"
    with pytest.raises(ValueError, match="master must be fp32"):
        as_master_range(torch.zeros(4, dtype=torch.float16)).kernel_operands(np.empty(0, dtype=np.uint8))
