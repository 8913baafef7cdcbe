import pytest
import torch

from slide_kernels import rms_norm

FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}


class LlamaRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm, verbatim math."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(torch.nn.Module):
    """transformers' GemmaRMSNorm (offset 1), generalized to any offset."""

    def __init__(self, weight, eps, offset=1.0):
        super().__init__()
        self.weight, self.eps, self.offset = weight, eps, offset

    def forward(self, x):
        output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (self.offset + self.weight.float())
        return output.type_as(x)


def run_both(x, weight, eps, offset, make_ref, **kwargs):
    xs, ws = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    y = rms_norm(xs, ws, eps, offset, **kwargs)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    yr = make_ref(wr, eps)(xr)
    yr.backward(dy.double())
    return (y, xs.grad, ws.grad), (yr, xr.grad, wr.grad)


def check(ours, theirs, tol=FP32_TOL):
    for name, a, b in zip(("y", "dx", "dweight"), ours, theirs, strict=True):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b.to(a.dtype), **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("shape", [(5, 16), (3, 7, 123), (37, 48), (2, 5, 37), (4, 130), (1, 1, 5)])
def test_llama(backend, shape):
    x = torch.randn(shape) * 3 + 0.5
    weight = torch.randn(shape[-1])
    check(*run_both(x, weight, 1e-6, 0.0, LlamaRMSNorm))


@pytest.mark.parametrize("shape", [(5, 16), (3, 7, 123), (37, 48)])
def test_gemma_offset_one(backend, shape):
    x = torch.randn(shape)
    weight = torch.randn(shape[-1]) * 0.1
    check(*run_both(x, weight, 1e-6, 1.0, GemmaRMSNorm))


def test_explicit_casting_mode_and_eps(backend):
    x, weight = torch.randn(9, 37), torch.randn(37)
    check(*run_both(x, weight, 1e-2, 0.0, lambda w, eps: GemmaRMSNorm(w, eps, 0.0), casting_mode="gemma"))
    check(*run_both(x, weight, 1e-2, 0.5, lambda w, eps: GemmaRMSNorm(w, eps, 0.5), casting_mode="llama"))


def test_non_contiguous_input_and_frozen_weight(backend):
    base = torch.randn(48, 6)
    x = base.t().requires_grad_()  # (6, 48), row stride 1 along the wrong axis
    weight = torch.randn(48)
    y = rms_norm(x, weight)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr = base.t().double().requires_grad_()
    yr = LlamaRMSNorm(weight.double(), 1e-6)(xr)
    yr.backward(dy.double())
    torch.testing.assert_close(y, yr.float(), **FP32_TOL)
    torch.testing.assert_close(x.grad, xr.grad.float(), **FP32_TOL)


def test_weight_shape_is_checked():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(3, 8), torch.randn(7))
    with pytest.raises(ValueError, match="casting_mode"):
        rms_norm(torch.randn(3, 8), torch.randn(8), casting_mode="t5")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, {"rtol": 1e-4, "atol": 1e-5}), (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})],
)
@pytest.mark.parametrize(("offset", "ref"), [(0.0, LlamaRMSNorm), (1.0, GemmaRMSNorm)])
def test_cuda(cuda_compiled, dtype, tol, offset, ref):
    x = torch.randn(4, 1031, 4096, device=cuda_compiled, dtype=dtype)
    weight = torch.randn(4096, device=cuda_compiled, dtype=dtype)
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = rms_norm(xs, ws, 1e-6, offset)
    dy = torch.randn_like(y)
    y.backward(dy)
    # reference: same module in the same dtype (HF behaviour), grads against fp32
    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    yr = ref(wr, 1e-6)(xr)
    torch.testing.assert_close(y, yr.to(dtype), **tol)
    x32, w32 = x.float().requires_grad_(), weight.float().requires_grad_()
    ref(w32, 1e-6)(x32).backward(dy.float())
    for a, b in ((xs.grad, x32.grad), (ws.grad, w32.grad)):
        assert a.dtype == dtype
        assert ((a.float() - b).norm() / b.norm()) < tol["rtol"]
