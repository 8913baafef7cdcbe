"""Shared setup for the slide-kernels tests.

Triton's interpreter must be switched on before triton (or any slide_kernels op module) is imported,
because ``triton.jit`` reads ``TRITON_INTERPRET`` when the kernels are decorated. ``setdefault`` lets a
GPU run override it: ``TRITON_INTERPRET=0 python -m pytest tests/kernels -m gpu`` compiles the
kernels for the GPU instead (the interpreter cannot run bf16).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("slide_kernels") is None:  # not pip-installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "slide-kernels" / "src"))

import pytest
import torch

from slide_kernels._backend import kernels_available, use_backend


@pytest.fixture(params=["triton", "torch"])
def backend(request):
    """Run the test once through the Triton kernels (interpreted on CPU) and once through the fallback."""
    if request.param == "triton" and not kernels_available("cpu"):
        pytest.skip("triton interpreter unavailable (triton missing or TRITON_INTERPRET=0)")
    with use_backend(request.param):
        yield request.param


@pytest.fixture
def cuda_compiled():
    """Gate for ``@pytest.mark.gpu`` tests: a CUDA device and compiled (not interpreted) kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("TRITON_INTERPRET=1: run GPU tests with TRITON_INTERPRET=0")
    with use_backend("auto"):
        yield torch.device("cuda")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
