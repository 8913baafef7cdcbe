"""Shared fixtures for the slide-io tests: seeded, never-zero random tensors of every dtype.

Test modules do not import from here (another test folder's conftest.py may own the module name
``conftest``); they get everything through fixtures.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

MakeTensor = Callable[..., torch.Tensor]


def _random(numel: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        out = torch.randint(0, 2, (numel,), generator=generator).bool()
        out[0] = True  # never all-False, which would read back equal from a zeroed file
        return out
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=generator) * 100 + 1).to(dtype)
    high = 256 if dtype == torch.uint8 else 2**62
    return torch.randint(1, high, (numel,), generator=generator, dtype=torch.int64).to(dtype)


@pytest.fixture
def make_tensor() -> MakeTensor:
    """``make_tensor(numel, dtype, seed=0)``: seeded random data (non-zero first element), on the CPU."""

    def make(numel: int, dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu") -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed * 7919 + numel)
        return _random(numel, dtype, generator).to(device)

    return make
