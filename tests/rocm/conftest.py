"""Fixtures for the slide-rocm tests: a simulated HIP or CUDA build, and optional modules on or off.

The simulation itself lives in rocm_sim.py (a unique module name, so it cannot clash with other test
folders' helpers).
"""

from __future__ import annotations

import sys
from types import ModuleType

import pytest
from rocm_sim import H200, MI300X, FakeGPU, install, make_fake_hipfile


@pytest.fixture
def fake_hip(monkeypatch: pytest.MonkeyPatch) -> FakeGPU:
    """A ROCm 6.2 build of torch with one MI300X."""
    return install(monkeypatch, MI300X, hip="6.2.41133")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeGPU:
    """A CUDA build of torch with one H200, for comparing the CUDA path."""
    return install(monkeypatch, H200, hip=None)


@pytest.fixture
def no_hipfile(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hipFile bindings importable, whatever this machine has installed."""
    for name in ("hipfile", "rocm.hipfile"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def fake_hipfile(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Importable hipFile bindings (a stand-in; see make_fake_hipfile)."""
    module = make_fake_hipfile()
    monkeypatch.setitem(sys.modules, "hipfile", module)
    monkeypatch.setitem(sys.modules, "hipfile.buffer", module.buffer_module)
    return module


@pytest.fixture
def no_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)


@pytest.fixture
def fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", ModuleType("flash_attn"))
