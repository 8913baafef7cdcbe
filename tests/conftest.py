"""Suite-wide setup that must happen before any test module imports triton.

Triton reads TRITON_INTERPRET when a kernel is first defined, so it has to be set before the first
import of slide_kernels anywhere in the session: without a GPU, kernels run in the interpreter (fp32).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
