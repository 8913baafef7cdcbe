import math

import pytest
import torch

from slide_kernels import attention, attention_backend

FP32_TOL = {"rtol": 1e-4, "atol": 1e-5}


def reference(q, k, v, causal=True, attn_mask=None, scale=None, softcap=None, sliding_window=None):
    """Naive float64 attention with explicit bottom-right causal / sliding-window masks."""
    q, k, v = q.double(), k.double(), v.double()
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    s_q, s_k = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(s_q)[:, None] + (s_k - s_q)
    j = torch.arange(s_k)[None, :]
    keep = torch.ones(s_q, s_k, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if sliding_window is not None:
        keep &= (i - j).abs() < sliding_window
    scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.double()
    return torch.softmax(scores, -1) @ v


def run_both(q, k, v, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, **kwargs)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_leaves, **kwargs)
    ref.backward(dout.double())
    return [out] + [t.grad for t in leaves], [ref] + [t.grad for t in ref_leaves]


def check(ours, theirs, tol=FP32_TOL):
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b.to(a.dtype), **tol, msg=lambda m, name=name: f"{name}: {m}")


def qkv(b=2, hq=4, hk=2, s_q=7, s_k=7, d=16):
    return torch.randn(b, hq, s_q, d), torch.randn(b, hk, s_k, d), torch.randn(b, hk, s_k, d)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("hq", "hk"), [(4, 4), (4, 2), (6, 1)])
def test_sdpa_path(causal, hq, hk):
    check(*run_both(*qkv(hq=hq, hk=hk), causal=causal))


@pytest.mark.parametrize("causal", [True, False])
def test_query_shorter_than_keys_is_bottom_right(causal):
    check(*run_both(*qkv(s_q=3, s_k=9), causal=causal, scale=0.3))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 3, 37])
def test_sliding_window(causal, window):
    check(*run_both(*qkv(s_q=11, s_k=11), causal=causal, sliding_window=window))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 4])
def test_softcap_eager_path(causal, window):
    q, k, v = qkv(s_q=9, s_k=9)
    assert attention_backend(q, k, v, softcap=2.0) == "eager"
    check(*run_both(q * 4, k * 4, v, causal=causal, softcap=2.0, sliding_window=window))


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("causal", [True, False])
def test_attn_mask(kind, softcap, causal):
    q, k, v = qkv(s_q=6, s_k=6)
    keep = (torch.rand(2, 1, 6, 6) > 0.3) | torch.eye(6, dtype=torch.bool)  # every row keeps one key
    if kind == "bool":
        mask = keep
    else:
        mask = torch.zeros(2, 1, 6, 6).masked_fill(~keep, -1e4) + 0.1 * torch.randn(2, 1, 6, 6)
    check(*run_both(q, k, v, causal=causal, attn_mask=mask, softcap=softcap))


def test_backend_on_cpu():
    q, k, v = qkv()
    assert attention_backend(q, k, v) == "sdpa"
    assert attention_backend(q, k, v, attn_mask=torch.ones(7, 7, dtype=torch.bool)) == "sdpa"
    assert attention_backend() in ("flash_attn", "sdpa")


def test_errors():
    q, k, v = qkv(hq=3, hk=2)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, v)
    with pytest.raises(ValueError, match="sliding_window"):
        attention(*qkv(), sliding_window=0)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"sliding_window": 64}, {"softcap": 20.0}, {"causal": False}])
def test_cuda_bf16(cuda_compiled, options):
    q = torch.randn(2, 8, 257, 64, device=cuda_compiled, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 257, 64, device=cuda_compiled, dtype=torch.bfloat16)
    v = torch.randn(2, 2, 257, 64, device=cuda_compiled, dtype=torch.bfloat16)
    out = attention(q, k, v, **options)
    ref = reference(q.cpu(), k.cpu(), v.cpu(), **options)
    rel = (out.double().cpu() - ref).norm() / ref.norm()
    assert rel < 2e-2, (attention_backend(q, k, v, softcap=options.get("softcap")), rel)
