"""PinnedRamTier: one slab, best-fit ranges, copies in and out."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from slide_core import TierError, plugins
from slide_io import PinnedRamTier
from slide_io.tiers.pinned_ram import SLAB_ALIGN

MiB = 1 << 20
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
ODD_SIZES = [1, 4095, 4097, 1_000_003]
MakeTensor = Callable[..., torch.Tensor]  # the ``make_tensor`` fixture from conftest.py


def _read(tier: PinnedRamTier, key: str, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    assert tier.get(key, out).result(timeout=10) is out
    return out


def test_registered_as_pinned_plugin() -> None:
    assert plugins.load("slide.tiers", "pinned") is PinnedRamTier


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", ODD_SIZES)
def test_round_trip(make_tensor: MakeTensor, dtype: torch.dtype, numel: int) -> None:
    tensor = make_tensor(numel, dtype)
    with PinnedRamTier(16 * MiB) as tier:
        assert tier.put("k", tensor).result(timeout=10) is None
        assert torch.equal(_read(tier, "k", tensor), tensor)


def test_shapes_and_strides_round_trip(make_tensor: MakeTensor) -> None:
    source = make_tensor(64 * 48).view(64, 48)[:, ::2]  # non-contiguous
    with PinnedRamTier(MiB) as tier:
        tier.put("k", source).result()
        out = torch.empty(64, 48)[:, 1::2]
        tier.get("k", out).result()
        assert torch.equal(out, source)
        flat = torch.empty(source.numel())
        tier.get("k", flat).result()
        assert torch.equal(flat, source.reshape(-1))


def test_allocator_called_once_at_open_with_uint8() -> None:
    calls: list[tuple[int, torch.dtype]] = []

    def alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
        calls.append((numel, dtype))
        return torch.empty(numel, dtype=dtype)

    tier = PinnedRamTier(3 * MiB + 5, alloc=alloc)
    assert calls == []
    with tier:
        tier.put("a", torch.ones(10)).result()
        tier.put("b", torch.ones(1000)).result()
    assert calls == [(3 * MiB + 5, torch.uint8)]


def test_many_requests_in_flight(make_tensor: MakeTensor) -> None:
    tensors = {f"k{i}": make_tensor(1000 + 37 * i, DTYPES[i % len(DTYPES)], seed=i) for i in range(64)}
    with PinnedRamTier(8 * MiB) as tier:
        puts = [tier.put(key, tensor) for key, tensor in tensors.items()]
        for future in puts:
            future.result(timeout=10)
        outs = {key: torch.empty_like(tensor) for key, tensor in tensors.items()}
        gets = [tier.get(key, outs[key]) for key in tensors]
        for future in gets:
            future.result(timeout=10)
    for key, tensor in tensors.items():
        assert torch.equal(outs[key], tensor), key


def test_ranges_are_aligned_and_same_size_overwrite_reuses_the_range(make_tensor: MakeTensor) -> None:
    slabs: list[torch.Tensor] = []

    def alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
        slabs.append(torch.empty(numel, dtype=dtype))
        return slabs[-1]

    with PinnedRamTier(MiB, alloc=alloc) as tier:
        base = slabs[0].data_ptr()
        views = [tier.reserve(f"k{i}", 4 * (i + 1) * 3, torch.float32) for i in range(10)]
        for view in views:
            assert (view.data_ptr() - base) % SLAB_ALIGN == 0
        before = views[3].data_ptr()
        tier.put("k3", make_tensor(views[3].numel())).result()  # same size: same range
        assert tier.reserve("k3", views[3].numel() * 4, torch.float32).data_ptr() == before


def test_overwrite_with_new_size_keeps_other_keys(make_tensor: MakeTensor) -> None:
    small, big, other = make_tensor(100), make_tensor(50_000, torch.bfloat16), make_tensor(777, torch.int64)
    with PinnedRamTier(MiB) as tier:
        tier.put("k", small).result()
        tier.put("other", other).result()
        tier.put("k", big).result()
        assert torch.equal(_read(tier, "k", big), big)
        tier.put("k", small).result()
        assert torch.equal(_read(tier, "k", small), small)
        assert torch.equal(_read(tier, "other", other), other)
        assert tier.used_bytes() == tier._ranges.span(400) + tier._ranges.span(777 * 8)


def test_delete_releases_space_and_frees_coalesce(make_tensor: MakeTensor) -> None:
    with PinnedRamTier(MiB) as tier:
        for i in range(4):
            tier.put(f"k{i}", make_tensor(MiB // 16, seed=i)).result()  # 4 x 256 KiB fill the slab
        assert tier.capacity_bytes() == 0
        for key in ("k1", "k3", "k0", "k2"):
            tier.delete(key)
        tier.delete("k1")  # unknown keys are ignored
        assert tier.capacity_bytes() == MiB
        whole = make_tensor(MiB, torch.uint8)
        tier.put("whole", whole).result()  # needs the four ranges merged back into one
        assert torch.equal(_read(tier, "whole", whole), whole)
        with pytest.raises(TierError, match="no key 'k0'"):
            tier.get("k0", torch.empty(MiB // 16))


def test_full_slab_names_requested_and_free_bytes_and_keeps_keys(make_tensor: MakeTensor) -> None:
    kept = make_tensor(100_000)
    with PinnedRamTier(MiB) as tier:
        tier.put("kept", kept).result()
        with pytest.raises(TierError) as info:
            tier.put("huge", make_tensor(300_000))
        message = str(info.value)
        assert "\n" not in message and "'huge'" in message
        assert "needs 1200128 bytes" in message and f"{MiB - 400128} of {MiB} bytes are free" in message
        with pytest.raises(TierError):  # a failed overwrite keeps the old value
            tier.put("kept", make_tensor(300_000))
        assert torch.equal(_read(tier, "kept", kept), kept)
        assert tier.capacity_bytes() == MiB - 400128


def test_reserve_gives_a_writable_typed_view(make_tensor: MakeTensor) -> None:
    data = make_tensor(4097, torch.bfloat16)
    with PinnedRamTier(MiB) as tier:
        view = tier.reserve("act", data.numel() * 2, torch.bfloat16)
        assert view.dtype == torch.bfloat16 and view.shape == (4097,)
        view.copy_(data)
        assert torch.equal(_read(tier, "act", data), data)
        with pytest.raises(ValueError, match="whole number"):
            tier.reserve("bad", 7, torch.float32)


def test_get_checks_dtype_and_numel(make_tensor: MakeTensor) -> None:
    with PinnedRamTier(MiB) as tier:
        tier.put("k", make_tensor(10)).result()
        with pytest.raises(TierError, match=r"holds 10 x torch\.float32"):
            tier.get("k", torch.empty(10, dtype=torch.float16))
        with pytest.raises(TierError, match="asked for 11"):
            tier.get("k", torch.empty(11))


def test_close_twice_and_use_after_close() -> None:
    tier = PinnedRamTier(MiB).open()
    tier.put("k", torch.ones(3)).result()
    tier.close()
    tier.close()
    with pytest.raises(TierError, match="closed"):
        tier.put("k", torch.ones(3))
    assert tier.capacity_bytes() == MiB
    with tier, pytest.raises(TierError, match="no key"):  # reopening starts empty
        tier.get("k", torch.empty(3))


def test_bad_capacity_and_bad_allocator() -> None:
    with pytest.raises(ValueError):
        PinnedRamTier(0)
    tier = PinnedRamTier(MiB, alloc=lambda numel, dtype: torch.empty(numel // 2, dtype=dtype))
    with pytest.raises(TierError, match="expected a flat uint8 tensor"):
        tier.open()
