"""Shared setup for the slide-kernels tests.

Triton's interpreter is switched on by tests/conftest.py, before anything imports triton, and only on a
machine without a CUDA device: there the kernels run interpreted in fp32 (the ``backend`` fixture). On a GPU
machine nothing is set, so ``python -m pytest -m gpu`` compiles the kernels for the GPU (the
``cuda_compiled`` fixture) with no environment variable to remember.
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("slide_kernels") is None:  # not pip-installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "slide-kernels" / "src"))

import pytest
import torch

from slide_kernels._backend import interpret_mode, kernels_available, use_backend


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
    if interpret_mode():
        pytest.skip("TRITON_INTERPRET is set: the kernels were defined for the interpreter; unset it")
    with use_backend("auto"):
        yield torch.device("cuda")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
