import pytest
import torch

from slide_kernels import apply_rotary

FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb with unsqueeze_dim=1."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotary_cos_sin(batch, seq, dim, base=10000.0, dtype=torch.float32, device="cpu"):
    """HF-style cos/sin: (B, S, D) with duplicated halves, random positions per batch row."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    pos = torch.randint(0, 4096, (batch, seq), device=device).float()
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_qk(b, hq, hk, s, d, transposed, dtype=torch.float32, device="cpu"):
    if transposed:  # HF: view(B, S, H, D).transpose(1, 2)
        q = torch.randn(b, s, hq, d, dtype=dtype, device=device).transpose(1, 2)
        k = torch.randn(b, s, hk, d, dtype=dtype, device=device).transpose(1, 2)
    else:
        q = torch.randn(b, hq, s, d, dtype=dtype, device=device)
        k = torch.randn(b, hk, s, d, dtype=dtype, device=device)
    return q, k


def run_both(q, k, cos, sin, ref_cos=None, ref_sin=None):
    ref_cos = cos if ref_cos is None else ref_cos
    ref_sin = sin if ref_sin is None else ref_sin
    qs, ks = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    q_out, k_out = apply_rotary(qs, ks, cos, sin)
    dq, dk = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward((q_out, k_out), (dq, dk))
    qr, kr = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rq, rk = reference(qr, kr, ref_cos.double(), ref_sin.double())
    torch.autograd.backward((rq, rk), (dq.double(), dk.double()))
    return (q_out, k_out, qs.grad, ks.grad), (rq, rk, qr.grad, kr.grad)


def check(ours, theirs, tol=FP32_TOL):
    for name, a, b in zip(("q_rot", "k_rot", "dq", "dk"), ours, theirs, strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(
    ("b", "hq", "hk", "s", "d"),
    [(1, 4, 4, 5, 8), (2, 6, 2, 7, 12), (2, 3, 1, 37, 20), (1, 8, 2, 5, 64)],
)
@pytest.mark.parametrize("transposed", [False, True])
def test_matches_hf(backend, b, hq, hk, s, d, transposed):
    q, k = make_qk(b, hq, hk, s, d, transposed)
    cos, sin = rotary_cos_sin(b, s, d)
    ours, theirs = run_both(q, k, cos, sin)
    check(ours, theirs)
    assert ours[0].stride() == q.stride() and ours[1].stride() == k.stride()  # layout preserved


@pytest.mark.parametrize("cos_shape", ["1SD", "SD"])
def test_broadcast_cos_sin(backend, cos_shape):
    q, k = make_qk(3, 4, 2, 9, 16, transposed=True)
    cos, sin = rotary_cos_sin(1, 9, 16)
    full_cos, full_sin = cos.expand(3, 9, 16), sin.expand(3, 9, 16)
    if cos_shape == "SD":
        cos, sin = cos[0], sin[0]
    check(*run_both(q, k, cos, sin, full_cos, full_sin))


def test_general_cos_sin_grad(backend):
    """Random (non-rotation) cos/sin: the backward is the exact transpose, not just the inverse."""
    q, k = make_qk(2, 4, 2, 5, 12, transposed=False)
    cos, sin = torch.randn(2, 5, 12), torch.randn(2, 5, 12)
    check(*run_both(q, k, cos, sin))


def test_backward_is_inverse_rotation(backend):
    q, k = make_qk(1, 2, 2, 6, 8, transposed=False)
    cos, sin = rotary_cos_sin(1, 6, 8)
    qs, ks = q.clone().requires_grad_(), k.clone().requires_grad_()
    q_out, k_out = apply_rotary(qs, ks, cos, sin)
    torch.autograd.backward((q_out, k_out), (q_out.detach(), k_out.detach()))
    torch.testing.assert_close(qs.grad, q, **FP32_TOL)
    torch.testing.assert_close(ks.grad, k, **FP32_TOL)


def test_inputs_not_modified(backend):
    q, k = make_qk(1, 2, 1, 4, 8, transposed=True)
    q0, k0 = q.clone(), k.clone()
    apply_rotary(q, k, *rotary_cos_sin(1, 4, 8))
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_shape_errors():
    q, k = make_qk(1, 2, 1, 4, 8, transposed=False)
    cos, sin = rotary_cos_sin(1, 4, 8)
    with pytest.raises(ValueError, match="cos"):
        apply_rotary(q, k, cos[:, :3], sin[:, :3])
    with pytest.raises(ValueError, match="even"):
        apply_rotary(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7])


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, {"rtol": 1e-4, "atol": 1e-5}), (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})],
)
def test_cuda(cuda_compiled, dtype, tol):
    q, k = make_qk(2, 32, 8, 1031, 128, transposed=True, dtype=dtype, device=cuda_compiled)
    cos, sin = rotary_cos_sin(2, 1031, 128, dtype=dtype, device=cuda_compiled)
    ours, theirs = run_both(q, k, cos, sin)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b.to(dtype), **tol)
