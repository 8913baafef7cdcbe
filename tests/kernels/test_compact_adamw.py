"""The bf16-moment AdamW kernel (slide_kernels/ops/compact_adamw.py) against the compact optimizer's torch
path and numba kernel (slide_core/optim/compact_adamw.py): interpreted on the CPU (fp32 arithmetic, as the
GPU runs it), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from slide_core import AdamWConfig
from slide_core.optim._adamw_kernels import step_scalars
from slide_core.optim.compact_adamw import CompactAdamW
from slide_core.optim.fused_adamw import FusedAdamW
from slide_core.optim.state_formats import STEP_SALT, stream_key
from slide_kernels._backend import kernels_available
from slide_kernels.ops.compact_adamw import adamw_bf16_moments


def _case(n: int, grad_dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    slab = torch.randn(n + 96, generator=gen) * 0.02
    grads = [
        (torch.randn(n, generator=gen) * 1e-2 * torch.rand(n, generator=gen) ** 4).to(grad_dtype) for _ in range(4)
    ]
    grads[1][:7] = 0.0  # zero gradients: moments decay, the master only decays
    return slab, grads


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _with_kernel(config: AdamWConfig, master: torch.Tensor, grads, state, device: torch.device, index0: int) -> None:
    for step, grad in enumerate(grads, start=1):
        decay = step % 2 == 1
        scale = 0.5 if step == 3 else 1.0
        key = stream_key(config.state_seed, step, STEP_SALT)
        done = adamw_bf16_moments(
            master, grad.to(device), state["exp_avg"], state["exp_avg_sq"],
            scalars=step_scalars(config, 1e-3, step, decay), grad_scale=scale, index0=index0, key=key,
        )  # fmt: skip
        assert done


def _with_optimizer(optimizer, master, grads, state) -> None:
    for step, grad in enumerate(grads, start=1):
        scale = 0.5 if step == 3 else 1.0
        optimizer.step(master, grad, state, lr=1e-3, step=step, decay=step % 2 == 1, grad_scale=scale)


def _run_both(device: torch.device, n: int, grad_dtype: torch.dtype, fused: bool):
    config = AdamWConfig(weight_decay=0.1, state_format="bf16", state_seed=3)
    slab, grads = _case(n, grad_dtype)
    reference_master = slab.clone()[96:]  # position 96 of its slab: the hash index starts there
    reference_state = {k: torch.zeros(n, dtype=torch.bfloat16) for k in ("exp_avg", "exp_avg_sq")}
    _with_optimizer(CompactAdamW(config, fused=fused), reference_master, grads, reference_state)
    master = slab.clone().to(device)[96:]
    state = {k: torch.zeros(n, dtype=torch.bfloat16, device=device) for k in ("exp_avg", "exp_avg_sq")}
    _with_kernel(config, master, grads, state, device, index0=96)
    return (master.cpu(), {k: v.cpu() for k, v in state.items()}), (reference_master, reference_state)


@pytest.mark.skipif(not kernels_available("cpu"), reason="needs Triton's interpreter")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_interpreted_kernel_matches_the_torch_path(grad_dtype: torch.dtype) -> None:
    """Moments bit for bit (the same fp32 moments rounded by the same hash at the same positions), the
    master to the last bits (the interpreter computes in numpy, whose fused multiply-add may round twice),
    over four steps with weight decay on and off, a gradient scale and zero gradients; a length that is not
    a multiple of the block."""
    (master, state), (want_master, want_state) = _run_both(torch.device("cpu"), 3000, grad_dtype, fused=False)
    for name in state:
        assert torch.equal(_bits(state[name]), _bits(want_state[name])), name
    torch.testing.assert_close(master, want_master, rtol=1e-6, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not FusedAdamW.available(), reason="needs numba")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_matches_the_host_kernel(grad_dtype: torch.dtype) -> None:
    """On the GPU against the numba kernel the host runs: master and moments bit for bit."""
    (master, state), (want_master, want_state) = _run_both(torch.device("cuda"), 1 << 20, grad_dtype, fused=True)
    for name in state:
        assert torch.equal(_bits(state[name]), _bits(want_state[name])), name
    assert torch.equal(_bits(master), _bits(want_master))


def test_slide_runs_give_the_compact_optimizer_the_kernel() -> None:
    """`slide train` and `slide bench` build their optimizer with make_optimizer: bf16 state gets the kernel
    for its device ranges, and so does the device replica that resident and streamed units use."""
    from slide_hf.setup import make_optimizer

    optimizer = make_optimizer("auto", AdamWConfig(state_format="bf16"))
    assert optimizer.device_kernel is adamw_bf16_moments
    assert optimizer.device_replica().device_kernel is adamw_bf16_moments
