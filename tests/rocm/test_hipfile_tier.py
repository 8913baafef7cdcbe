"""The experimental hipFile tier: clear refusal without bindings, and put/get through stand-in bindings.

The stand-in (rocm_sim.make_fake_hipfile) does POSIX I/O on host addresses; real hipFile DMAs into GPU
memory. These tests check the tier's own logic, not hipFile.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from rocm_sim import FakeHipFileException, make_fake_hipfile

from slide_core import Tier, TierError, plugins
from slide_rocm import HipFileTier
from slide_rocm.hipfile_tier import DIRECT_IO_ALIGNMENT


def test_without_bindings_construction_says_use_nvme(no_hipfile: None, tmp_path: Path) -> None:
    with pytest.raises(TierError, match=r"needs AMD hipFile Python bindings.*use the nvme tier"):
        HipFileTier(tmp_path)


def test_entry_point_and_experimental_flag() -> None:
    plugins._entry_points.cache_clear()
    assert "hipfile" in plugins.available("slide.tiers")
    assert plugins.load("slide.tiers", "hipfile", Tier) is HipFileTier
    assert HipFileTier.experimental is True
    assert HipFileTier.name == "hipfile"


def test_old_bindings_without_file_io_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    old = make_fake_hipfile(with_io=False)
    monkeypatch.setitem(sys.modules, "hipfile", old)
    monkeypatch.setitem(sys.modules, "hipfile.buffer", old.buffer_module)
    with pytest.raises(TierError, match=r"lack FileHandle.read, FileHandle.write; .*Use the nvme tier"):
        HipFileTier(tmp_path)


def test_bindings_missing_a_class_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    partial = make_fake_hipfile()
    monkeypatch.setitem(sys.modules, "hipfile", partial)
    monkeypatch.setitem(sys.modules, "hipfile.buffer", None)  # Buffer nowhere to be found
    with pytest.raises(TierError, match=r"lack Buffer"):
        HipFileTier(tmp_path)


def _page_tensor(pages: int = 2, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    numel = pages * DIRECT_IO_ALIGNMENT // torch.empty(0, dtype=dtype).element_size()
    return torch.randn(numel).to(dtype)


def test_put_get_roundtrip(fake_hipfile: ModuleType, tmp_path: Path) -> None:
    root = tmp_path / "scratch"
    with HipFileTier(root) as tier:
        assert fake_hipfile.state.driver_open == 1
        value = _page_tensor(3, torch.bfloat16)
        assert tier.put("layers/0/master", value).result() is None
        assert fake_hipfile.state.last_flags & getattr(os, "O_DIRECT", 0) == getattr(os, "O_DIRECT", 0)
        out = torch.zeros_like(value)
        assert tier.get("layers/0/master", out).result() is out
        assert torch.equal(out, value)
        files = list(root.iterdir())
        assert [f.name for f in files] == ["layers%2F0%2Fmaster.bin"]
        assert isinstance(tier.capacity_bytes(), int)
        tier.delete("layers/0/master")
        assert list(root.iterdir()) == []
        with pytest.raises(TierError, match="no key 'layers/0/master'"):
            tier.get("layers/0/master", out)
    assert fake_hipfile.state.driver_open == 0


def test_close_removes_scratch_files(fake_hipfile: ModuleType, tmp_path: Path) -> None:
    tier = HipFileTier(tmp_path).open()
    tier.put("a", _page_tensor()).result()
    tier.put("b", _page_tensor()).result()
    assert len(list(tmp_path.iterdir())) == 2
    tier.close()
    tier.close()  # safe twice
    assert list(tmp_path.iterdir()) == []


def test_errors_name_key_and_bytes(fake_hipfile: ModuleType, tmp_path: Path) -> None:
    tier = HipFileTier(tmp_path)
    with pytest.raises(TierError, match="closed"):
        tier.put("k", _page_tensor())
    with tier:
        with pytest.raises(TierError, match=r"key 'k': 400 B \(400 bytes\) is not a multiple of 4096"):
            tier.put("k", torch.zeros(100))
        with pytest.raises(TierError, match="contiguous"):
            tier.put("k", _page_tensor(4).reshape(64, -1).t())
        tier.put("k", _page_tensor(2)).result()
        with pytest.raises(TierError, match=r"holds 2048 x torch.float32, asked for 4096 x torch.float16"):
            tier.get("k", torch.zeros(4096, dtype=torch.float16))


def test_io_failures_surface_through_the_future(fake_hipfile: ModuleType, tmp_path: Path) -> None:
    with HipFileTier(tmp_path) as tier:
        fake_hipfile.state.fail_next = FakeHipFileException(5011, 1)
        future = tier.put("k", _page_tensor())
        with pytest.raises(TierError, match=r"hipfile tier write of 8.00 KiB at .*k.bin failed"):
            future.result()
        tier.put("k", _page_tensor()).result()
        fake_hipfile.state.short_next = True
        with pytest.raises(TierError, match="moved 4096 of 8192 bytes"):
            tier.get("k", torch.zeros(2048)).result()


def test_buffered_mode_allows_any_size(fake_hipfile: ModuleType, tmp_path: Path) -> None:
    with HipFileTier(tmp_path, direct=False) as tier:
        value = torch.arange(100, dtype=torch.int32)
        tier.put("odd", value).result()
        assert fake_hipfile.state.last_flags & getattr(os, "O_DIRECT", 0) == 0
        out = torch.zeros_like(value)
        tier.get("odd", out).result()
        assert torch.equal(out, value)
