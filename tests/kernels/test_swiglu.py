import pytest
import torch
import torch.nn.functional as F

from slide_kernels import geglu, swiglu

FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}


def swiglu_ref(gate, up):
    """LlamaMLP: act_fn(gate_proj(x)) * up_proj(x) with act_fn = silu."""
    return F.silu(gate) * up


def geglu_ref(gate, up):
    """GemmaMLP: gelu_pytorch_tanh(gate) * up."""
    return F.gelu(gate, approximate="tanh") * up


OPS = [(swiglu, swiglu_ref), (geglu, geglu_ref)]


def run_both(op, ref, gate, up):
    gs, us = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    out = op(gs, us)
    dout = torch.randn_like(out)
    out.backward(dout)
    gr, ur = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    out_ref = ref(gr, ur)
    out_ref.backward(dout.double())
    return (out, gs.grad, us.grad), (out_ref, gr.grad, ur.grad)


def check(ours, theirs, tol=FP32_TOL):
    for name, a, b in zip(("out", "d_gate", "d_up"), ours, theirs, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b.to(a.dtype), **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(("op", "ref"), OPS, ids=["swiglu", "geglu"])
@pytest.mark.parametrize("shape", [(5,), (3, 123), (2, 37, 48), (1031,), (4, 7, 130)])
def test_matches_reference(backend, op, ref, shape):
    gate, up = torch.randn(shape) * 3, torch.randn(shape)
    check(*run_both(op, ref, gate, up))


@pytest.mark.parametrize(("op", "ref"), OPS, ids=["swiglu", "geglu"])
def test_saturated_inputs(backend, op, ref):
    """Large |gate|: the sigmoid/tanh must saturate cleanly, no inf/NaN."""
    gate = torch.linspace(-60, 60, 241)
    up = torch.randn(241)
    ours, theirs = run_both(op, ref, gate, up)
    for a in ours:
        assert torch.isfinite(a).all()
    check(ours, theirs)


@pytest.mark.parametrize(("op", "ref"), OPS, ids=["swiglu", "geglu"])
def test_non_contiguous(backend, op, ref):
    fused = torch.randn(6, 2 * 37)
    gate, up = fused[:, :37], fused[:, 37:]  # the chunk() of a merged gate_up projection
    check(*run_both(op, ref, gate, up))


def test_mismatch_errors():
    with pytest.raises(ValueError, match="shape"):
        swiglu(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="dtype"):
        geglu(torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize(("op", "ref"), OPS, ids=["swiglu", "geglu"])
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, {"rtol": 1e-4, "atol": 1e-5}), (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})],
)
def test_cuda(cuda_compiled, op, ref, dtype, tol):
    gate = torch.randn(1031, 14336, device=cuda_compiled, dtype=dtype)
    up = torch.randn(1031, 14336, device=cuda_compiled, dtype=dtype)
    ours, theirs = run_both(op, ref, gate, up)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b.to(dtype), **tol)
