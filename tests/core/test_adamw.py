"""TorchAdamW (slide_core/optim/adamw.py) in chunks: bit for bit torch.optim.AdamW's own kernels on a range
of several chunks, and the device scratch it reports is what it allocates (counted op by op)."""

from __future__ import annotations

import pytest
import torch

from slide_core import AdamWConfig
from slide_core.alloc_counter import AllocationCounter
from slide_core.optim import TorchAdamW
from slide_core.optimizer import Correction

CHUNK = 1000
N = 3 * CHUNK + 417  # several chunks, ending inside one
LR = 1e-3


def _grads(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(N, generator=gen).add_(0.01).to(dtype) for _ in range(4)]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_chunks_are_bit_identical_to_torch_optim_adamw(fused: bool, grad_dtype: torch.dtype) -> None:
    """``fused=False`` is torch.optim.AdamW's single-tensor arithmetic (its ``denom`` now written into a
    kept scratch), ``fused=True`` its ``_fused_adamw_``: each chunked, each bit for bit torch's own."""
    if fused and not hasattr(torch, "_fused_adamw_"):
        pytest.skip("this torch build has no _fused_adamw_")
    master = torch.randn(N, generator=torch.Generator().manual_seed(2))
    param = torch.nn.Parameter(master.clone())
    reference = torch.optim.AdamW([param], lr=LR, weight_decay=0.05, foreach=False, fused=fused)
    optimizer = TorchAdamW(AdamWConfig(weight_decay=0.05), fused=fused, chunk_numel=CHUNK)
    state = {"exp_avg": torch.zeros(N), "exp_avg_sq": torch.zeros(N)}
    for step, grad in enumerate(_grads(grad_dtype), start=1):
        param.grad = grad.float()
        reference.step()
        optimizer.step(master, grad, state, lr=LR, step=step, decay=True)
    want = reference.state[param]
    assert torch.equal(master, param.detach())
    assert torch.equal(state["exp_avg"], want["exp_avg"])
    assert torch.equal(state["exp_avg_sq"], want["exp_avg_sq"])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("numel", [N, CHUNK // 2])
def test_device_scratch_bytes_is_what_a_replica_allocates(fused: bool, numel: int) -> None:
    """A fresh device replica's step (bf16 gradients, as a resident unit's slot holds) and correction
    (a 0-dim coefficient, as resident units pass) allocate exactly what ``device_scratch_bytes`` says:
    one chunk's scratch, not a copy of the range, for a range longer than a chunk."""
    optimizer = TorchAdamW(AdamWConfig(weight_decay=0.1), fused=fused, chunk_numel=CHUNK).device_replica()
    master, grad = torch.randn(numel), torch.randn(numel).bfloat16()
    state = {"exp_avg": torch.zeros(numel), "exp_avg_sq": torch.zeros(numel)}
    with AllocationCounter() as counter:
        optimizer.step(master, grad, state, lr=LR, step=1, decay=True)
        stepped = counter.peak_bytes
        optimizer.correct(
            master, grad, state, applied=torch.tensor(0.5), correction=Correction("undo"), lr=LR, step=1, decay=True
        )
    assert stepped == optimizer.device_scratch_bytes(numel)
    assert counter.peak_bytes == optimizer.device_scratch_bytes(numel, corrects=True)
    assert stepped < 4 * numel or numel <= CHUNK
