import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import slide_kernels
from slide_kernels import _backend, kernels_available, use_backend

SRC = str(Path(slide_kernels.__file__).resolve().parents[1])


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": SRC, **env}
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120)


def test_public_api():
    for name in slide_kernels.__all__:
        obj = getattr(slide_kernels, name)
        assert callable(obj) and obj.__doc__, name
    with pytest.raises(AttributeError):
        slide_kernels.not_there  # noqa: B018


@pytest.mark.slow  # a fresh Python process: seconds of imports
def test_import_is_lazy_and_works_without_triton():
    code = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import slide_kernels
assert "torch" not in sys.modules and "slide_kernels.ops.rms_norm" not in sys.modules
import torch
assert slide_kernels.kernels_available("cuda") is False and slide_kernels.kernels_available("cpu") is False
x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8)
slide_kernels.rms_norm(x, w).sum().backward()
h, W, t = torch.randn(4, 8, requires_grad=True), torch.randn(11, 8), torch.tensor([1, 2, -100, 3])
slide_kernels.linear_cross_entropy(h, W, t).backward()
assert x.grad is not None and h.grad is not None
print("ok")
"""
    result = run_python(code, TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_kernels_available_cpu_follows_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernels_available("cpu") is False
    assert _backend.use_triton(torch.zeros(1)) is False
    with use_backend("triton"), pytest.raises(RuntimeError, match="forced"):
        _backend.use_triton(torch.zeros(1))
    assert kernels_available("mps") is False


def test_overrides(monkeypatch):
    monkeypatch.setenv("SLIDE_KERNELS_BACKEND", "torch")
    assert _backend.use_triton(torch.zeros(1)) is False
    monkeypatch.setenv("SLIDE_KERNELS_BACKEND", "bogus")
    with pytest.raises(ValueError, match="SLIDE_KERNELS_BACKEND"):
        _backend.use_triton(torch.zeros(1))
    with pytest.raises(ValueError):
        use_backend("cuda").__enter__()


@pytest.mark.parametrize(("block", "warps"), [(16, 1), (128, 4), (2048, 8), (8192, 16), (65536, 32)])
def test_num_warps(block, warps):
    assert _backend.num_warps_for(block) == warps
