"""The compact-moment AdamW kernels (slide_kernels/ops/compact_adamw.py) against the compact optimizer's
torch path and numba kernel (slide_core/optim/compact_adamw.py): interpreted on the CPU (fp32 arithmetic,
as the GPU runs it), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from slide_core import AdamWConfig
from slide_core.optim._adamw_kernels import step_scalars
from slide_core.optim.compact_adamw import CompactAdamW
from slide_core.optim.fused_adamw import FusedAdamW
from slide_core.optim.state_formats import STEP_SALT, state_arrays, stream_key
from slide_kernels._backend import kernels_available
from slide_kernels.ops.compact_adamw import adamw_compact_moments

OFFSET = 128  # the range starts at this position of its slab: the hash index starts there


def _grads(n: int, grad_dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # several orders of magnitude inside each 64-element block, and zero gradients on one step
    grads = [
        (torch.randn(n, generator=gen) * 1e-2 * torch.rand(n, generator=gen) ** 4).to(grad_dtype) for _ in range(4)
    ]
    grads[1][:70] = 0.0
    return grads


def _empty_state(state_format: str, n: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {a.name: torch.zeros(a.numel(n), dtype=a.dtype, device=device) for a in state_arrays(state_format)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


def _schedule(step: int) -> tuple[bool, float]:
    """Weight decay on odd steps, a gradient scale on the third."""
    return step % 2 == 1, 0.5 if step == 3 else 1.0


def _run_both(state_format: str, device: torch.device, n: int, grad_dtype: torch.dtype, fused: bool):
    config = AdamWConfig(weight_decay=0.1, state_format=state_format, state_seed=3)
    slab = torch.randn(n + OFFSET, generator=torch.Generator().manual_seed(1)) * 0.02
    grads = _grads(n, grad_dtype)
    want_master, want_state = slab.clone()[OFFSET:], _empty_state(state_format, n, torch.device("cpu"))
    optimizer = CompactAdamW(config, fused=fused)
    master, state = slab.clone().to(device)[OFFSET:], _empty_state(state_format, n, device)
    for step, grad in enumerate(grads, start=1):
        decay, scale = _schedule(step)
        optimizer.step(want_master, grad, want_state, lr=1e-3, step=step, decay=decay, grad_scale=scale)
        done = adamw_compact_moments(
            master, grad.to(device), state, scalars=step_scalars(config, 1e-3, step, decay), grad_scale=scale,
            index0=OFFSET, key=stream_key(config.state_seed, step, STEP_SALT),
        )  # fmt: skip
        assert done
    return (master.cpu(), {k: v.cpu() for k, v in state.items()}), (want_master, want_state)


@pytest.mark.skipif(not kernels_available("cpu"), reason="needs Triton's interpreter")
@pytest.mark.parametrize("state_format", ["bf16", "int8"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_interpreted_kernel_matches_the_torch_path(state_format: str, grad_dtype: torch.dtype) -> None:
    """The same moments rounded by the same hash at the same positions. The interpreter computes a fused
    multiply-add in numpy with two roundings, so a moment may differ from the host's in its last bit: bf16
    codes then still agree (a stochastic rounding flips on one ulp about once in 2^16), an int8 block's
    scale (its largest moment) by a few ulp, and its codes by at most one step, rarely; the master to
    its last bits. (Compiled on a GPU, where the multiply-add is fused, everything is bit for bit: the
    test below.) Four steps with weight decay on and off, a gradient scale and zero gradients; more
    elements than one program takes, not a multiple of it."""
    (master, state), (want_master, want_state) = _run_both(
        state_format, torch.device("cpu"), 64 * 47, grad_dtype, fused=False
    )
    for name, tensor in state.items():
        if tensor.dtype == torch.float32:  # int8 block scales
            torch.testing.assert_close(tensor, want_state[name], rtol=1e-6, atol=0.0)
            continue
        diff = (_bits(tensor).to(torch.int64) - _bits(want_state[name]).to(torch.int64)).abs()
        if state_format == "bf16":
            assert torch.equal(diff, torch.zeros_like(diff)), name
        else:
            assert diff.max() <= 1 and (diff > 0).float().mean() < 0.05, name
    torch.testing.assert_close(master, want_master, rtol=1e-6, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not FusedAdamW.available(), reason="needs numba")
@pytest.mark.parametrize("state_format", ["bf16", "int8"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_matches_the_host_kernel(state_format: str, grad_dtype: torch.dtype) -> None:
    """On the GPU against the numba kernel the host runs: master and moments bit for bit."""
    (master, state), (want_master, want_state) = _run_both(
        state_format, torch.device("cuda"), 1 << 20, grad_dtype, fused=True
    )
    for name in state:
        assert torch.equal(_bits(state[name]), _bits(want_state[name])), name
    assert torch.equal(_bits(master), _bits(want_master))


@pytest.mark.parametrize("state_format", ["bf16", "int8"])
def test_slide_runs_give_the_compact_optimizer_the_kernel(state_format: str) -> None:
    """`slide train` and `slide bench` build their optimizer with make_optimizer: compact state gets the
    kernel for its device ranges, and so does the device replica that resident and streamed units use."""
    from slide_hf.setup import make_optimizer

    optimizer = make_optimizer("auto", AdamWConfig(state_format=state_format))
    assert optimizer.device_kernel is adamw_compact_moments
    assert optimizer.device_replica().device_kernel is adamw_compact_moments


def test_a_range_the_kernels_do_not_take_is_left_alone() -> None:
    """fp32 moments, or an int8 range that does not start and end on a scale block: False, nothing
    written, and the optimizer takes its torch path."""
    n = 64 * 3
    master, grad = torch.zeros(n), torch.ones(n)
    scalars = step_scalars(AdamWConfig(), 1e-3, 1, True)
    fp32 = {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
    assert not adamw_compact_moments(master, grad, fp32, scalars=scalars, grad_scale=1.0, index0=0, key=(1, 2))
    ragged = _empty_state("int8", n, torch.device("cpu"))
    ragged = {k: v[:-1] if v.numel() == n else v for k, v in ragged.items()}
    assert not adamw_compact_moments(
        master[:-1], grad[:-1], ragged, scalars=scalars, grad_scale=1.0, index0=0, key=(1, 2)
    )
    assert torch.equal(master, torch.zeros(n))
