import pytest
import torch
import torch.nn.functional as F

from slide_kernels import linear_cross_entropy
from slide_kernels.ops import linear_cross_entropy as lce_module

FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}


def reference(
    hidden,
    weight,
    target,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    softcap=None,
    label_smoothing=0.0,
    accum_dtype=None,
):
    """Plain PyTorch: materialize the logits, softcap, F.cross_entropy on fp32 logits (0 if all ignored)."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(
        logits.float(), target, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
    )
    if reduction == "mean" and bool((target == ignore_index).all()):
        loss = (logits * 0.0).sum()  # torch gives NaN; we define 0 (and zero grads)
    return loss


def make_inputs(n, h, v, *, bias=False, ignore_frac=0.25, ignore_index=-100, dtype=torch.float32, device="cpu"):
    hidden = torch.randn(n, h, dtype=dtype, device=device)
    weight = torch.randn(v, h, dtype=dtype, device=device) / h**0.5 * 4  # logits of O(4)
    target = torch.randint(0, v, (n,), device=device)
    drop = torch.rand(n, device=device) < ignore_frac
    target[drop] = ignore_index
    b = torch.randn(v, dtype=dtype, device=device) if bias else None
    return hidden, weight, target, b


def run_both(hidden, weight, target, bias, grad_scale=1.0, **kwargs):
    """Loss and grads of ours and of the float64 reference, for the same inputs."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    b = None if bias is None else bias.detach().clone().requires_grad_()
    loss = linear_cross_entropy(leaves[0], leaves[1], target, bias=b, **kwargs)
    (loss * grad_scale).backward()
    ref_leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    rb = None if bias is None else bias.detach().double().requires_grad_()
    ref = reference(ref_leaves[0], ref_leaves[1], target, rb, **kwargs)
    (ref * grad_scale).backward()
    ours = [loss, leaves[0].grad, leaves[1].grad] + ([b.grad] if b is not None else [])
    theirs = [ref, ref_leaves[0].grad, ref_leaves[1].grad] + ([rb.grad] if rb is not None else [])
    return ours, theirs


def check(ours, theirs, tol=FP32_TOL):
    for name, a, b in zip(("loss", "d_hidden", "d_weight", "d_bias"), ours, theirs, strict=False):
        assert a.dtype == (torch.float32 if name == "loss" else a.dtype)
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b.to(a.dtype), **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture
def small_chunks(monkeypatch):
    """Force several chunks even at test sizes (chunk = 8 rows of fp32 logits at V=130)."""
    monkeypatch.setattr(lce_module, "CHUNK_LOGITS_BYTES", 8 * 130 * 4)


@pytest.mark.parametrize(("n", "h", "v"), [(5, 16, 37), (37, 48, 130), (16, 32, 123)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_reference(backend, n, h, v, reduction):
    hidden, weight, target, _ = make_inputs(n, h, v)
    check(*run_both(hidden, weight, target, None, reduction=reduction))


@pytest.mark.parametrize(
    "options",
    [
        {"softcap": 3.0},
        {"label_smoothing": 0.1},
        {"bias": True},
        {"softcap": 5.0, "label_smoothing": 0.2, "bias": True},
        {"softcap": 3.0, "label_smoothing": 0.1, "bias": True, "reduction": "sum"},
        {"ignore_index": 3},
    ],
)
def test_options(backend, small_chunks, options):
    options = dict(options)
    ignore_index = options.get("ignore_index", -100)
    hidden, weight, target, bias = make_inputs(37, 48, 130, bias=options.pop("bias", False), ignore_index=ignore_index)
    check(*run_both(hidden, weight, target, bias, **options))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunking_does_not_change_result(backend, small_chunks, reduction):
    hidden, weight, target, bias = make_inputs(37, 48, 130, bias=True)
    check(*run_both(hidden, weight, target, bias, reduction=reduction, label_smoothing=0.05))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_is_zero_not_nan(backend, reduction):
    hidden, weight, target, bias = make_inputs(6, 16, 37, bias=True, ignore_frac=1.1)
    assert (target == -100).all()
    ours, _ = run_both(hidden, weight, target, bias, reduction=reduction, label_smoothing=0.1)
    for tensor in ours:
        assert torch.equal(tensor, torch.zeros_like(tensor))


def test_grad_output_scales_stored_grads(backend):
    hidden, weight, target, bias = make_inputs(37, 48, 130, bias=True)
    check(*run_both(hidden, weight, target, bias, grad_scale=2.5, softcap=4.0))


def test_leading_dims_and_frozen_weight(backend):
    hidden, weight, target, _ = make_inputs(12, 16, 37)
    h = hidden.view(3, 4, 16).clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, target.view(3, 4))  # weight does not require grad
    loss.backward()
    h_ref = hidden.double().requires_grad_()
    ref = reference(h_ref, weight.double(), target)
    ref.backward()
    torch.testing.assert_close(loss, ref.float(), **FP32_TOL)
    torch.testing.assert_close(h.grad, h_ref.grad.float().view(3, 4, 16), **FP32_TOL)


def test_no_grad_returns_loss_only(backend):
    hidden, weight, target, _ = make_inputs(9, 16, 37)
    weight.requires_grad_()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, target, softcap=2.0)
    assert loss.grad_fn is None and loss.dim() == 0
    torch.testing.assert_close(loss, reference(hidden.double(), weight.double(), target, softcap=2.0).float())


def test_fp32_accumulation_option(backend, small_chunks):
    hidden, weight, target, bias = make_inputs(37, 48, 130, bias=True)
    check(*run_both(hidden, weight, target, bias, accum_dtype=torch.float64))


def test_second_backward_is_refused(backend):
    hidden, weight, target, _ = make_inputs(5, 16, 37)
    weight.requires_grad_()
    loss = linear_cross_entropy(hidden, weight, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


def test_bad_arguments():
    hidden, weight, target, _ = make_inputs(5, 16, 37)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, target, reduction="none")
    with pytest.raises(ValueError, match="target"):
        linear_cross_entropy(hidden, weight, target[:4])
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(hidden, weight, target, softcap=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, {"rtol": 2e-3, "atol": 1e-5}), (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-3})],
)
@pytest.mark.parametrize("options", [{}, {"softcap": 30.0, "label_smoothing": 0.1, "bias": True}])
def test_cuda(cuda_compiled, dtype, tol, options, monkeypatch):
    options = dict(options)
    monkeypatch.setattr(lce_module, "CHUNK_LOGITS_BYTES", 256 * 32000 * 2)  # several chunks
    hidden, weight, target, bias = make_inputs(
        1031, 512, 32000, bias=options.pop("bias", False), dtype=dtype, device=cuda_compiled
    )
    ours, theirs = run_both(hidden, weight, target, bias, **options)
    torch.testing.assert_close(ours[0], theirs[0].float(), **tol)
    for a, b in zip(ours[1:], theirs[1:], strict=True):
        assert a.dtype == dtype
        rel = (a.double() - b).norm() / b.norm()
        assert rel < tol["rtol"], rel


def test_launcher_accumulates_into_caller_buffers(backend, small_chunks):
    """Engine hook: add the head's grads into persistent (here fp64) buffers, no autograd."""
    hidden, weight, target, bias = make_inputs(37, 48, 130, bias=True)
    gw0, gb0 = torch.randn(130, 48, dtype=torch.float64), torch.randn(130, dtype=torch.float64)
    gw, gb = gw0.clone(), gb0.clone()
    loss, d_hidden, d_weight, d_bias = lce_module.linear_cross_entropy_forward(
        hidden, weight, target, bias, label_smoothing=0.1, grad_weight_out=gw, grad_bias_out=gb
    )
    assert d_weight is gw and d_bias is gb
    _, theirs = run_both(hidden, weight, target, bias, label_smoothing=0.1)
    check([loss, d_hidden, d_weight - gw0, d_bias - gb0], theirs)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_grad_weight_out_is_written_and_returned_as_the_gradient(backend, small_chunks, softcap):
    """Autograd API with a caller-owned weight-gradient buffer (the engine's slot): stale contents are
    overwritten, the backward's scale is applied in place, and autograd hands back that very buffer."""
    hidden, weight, target, _ = make_inputs(37, 48, 130)
    expected = run_both(hidden, weight, target, None, grad_scale=0.37, reduction="sum", softcap=softcap)[0]
    buffer = torch.full_like(weight, float("nan"))  # stale contents must not leak into the gradient
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = linear_cross_entropy(h, w, target, reduction="sum", softcap=softcap, grad_weight_out=buffer)
    grad_h, grad_w = torch.autograd.grad(loss * 0.37, [h, w])
    assert grad_w.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(loss, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(grad_h, expected[1], rtol=0, atol=0)
    torch.testing.assert_close(grad_w, expected[2], rtol=0, atol=0)


def test_grad_weight_out_rejects_a_buffer_autograd_would_copy(backend):
    hidden, weight, target, _ = make_inputs(5, 16, 37)
    with pytest.raises(ValueError, match="grad_weight_out must have the weight's dtype"):
        linear_cross_entropy(hidden, weight, target, grad_weight_out=torch.empty(37, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"grad_weight_out must be a floating-point tensor of shape \(37, 16\)"):
        linear_cross_entropy(hidden, weight.requires_grad_(), target, grad_weight_out=torch.empty(36, 16))


def test_launcher_overwrites_caller_buffers_when_not_accumulating(backend, small_chunks):
    hidden, weight, target, bias = make_inputs(37, 48, 130, bias=True)
    gw, gb = torch.full((130, 48), float("nan"), dtype=torch.float64), torch.full((130,), float("nan"))
    loss, d_hidden, d_weight, d_bias = lce_module.linear_cross_entropy_forward(
        hidden, weight, target, bias, grad_weight_out=gw, grad_bias_out=gb, accumulate_grad_out=False
    )
    assert d_weight is gw and d_bias is gb
    _, theirs = run_both(hidden, weight, target, bias)
    check([loss, d_hidden, d_weight, d_bias], theirs)


def _weighted_reference(hidden, weight, target, row_weight, *, reduction, softcap=None, label_smoothing=0.0):
    """Plain PyTorch: per-token cross-entropy (no reduction) times the row weights, summed or divided by
    the count of non-ignored targets."""
    logits = hidden @ weight.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    rows = F.cross_entropy(logits.float(), target, reduction="none", label_smoothing=label_smoothing)
    total = (rows * row_weight).sum()
    return total / (target != -100).sum().clamp(min=1) if reduction == "mean" else total


@pytest.mark.parametrize(("n", "h", "v"), [(5, 16, 37), (37, 48, 130), (123, 32, 123)])
@pytest.mark.parametrize(
    "options",
    [{"reduction": "sum"}, {"reduction": "mean"}, {"reduction": "sum", "softcap": 3.0, "label_smoothing": 0.1}],
)
def test_row_weights_scale_each_rows_loss_and_gradient(backend, small_chunks, n, h, v, options):
    """Per-row weights, negative ones and zeros among them (a preference loss's token weights), against
    ``F.cross_entropy(reduction="none") * weight``, in fp32 (the interpreter without a GPU)."""
    hidden, weight, target, _ = make_inputs(n, h, v)
    row_weight = torch.randn(n)
    row_weight[::4] = 0.0
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    loss = linear_cross_entropy(leaves[0], leaves[1], target, row_weight=row_weight, **options)
    (loss * 1.5).backward()
    ref_leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    ref = _weighted_reference(ref_leaves[0], ref_leaves[1], target, row_weight.double(), **options)
    (ref * 1.5).backward()
    check([loss, leaves[0].grad, leaves[1].grad], [ref, ref_leaves[0].grad, ref_leaves[1].grad])


def test_rows_out_receives_each_rows_loss(backend, small_chunks):
    hidden, weight, target, _ = make_inputs(37, 48, 130)
    rows = torch.empty(37)
    loss, *_ = lce_module.linear_cross_entropy_forward(
        hidden, weight, target, reduction="sum", grad_hidden=False, grad_weight=False, rows_out=rows
    )
    expected = F.cross_entropy(hidden.double() @ weight.double().T, target, reduction="none")
    torch.testing.assert_close(rows, expected.float(), **FP32_TOL)
    torch.testing.assert_close(loss, rows.sum())


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, {"rtol": 2e-3, "atol": 1e-5}), (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-3})],
)
def test_cuda_row_weights(cuda_compiled, dtype, tol, monkeypatch):
    """The compiled kernel's row weights at a real vocabulary, several chunks, against float64 torch."""
    monkeypatch.setattr(lce_module, "CHUNK_LOGITS_BYTES", 256 * 32000 * 2)
    hidden, weight, target, _ = make_inputs(1031, 512, 32000, dtype=dtype, device=cuda_compiled)
    row_weight = torch.randn(1031, device=cuda_compiled)
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    loss = linear_cross_entropy(leaves[0], leaves[1], target, reduction="sum", softcap=30.0, row_weight=row_weight)
    loss.backward()
    ref_leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    ref = _weighted_reference(ref_leaves[0], ref_leaves[1], target, row_weight.double(), reduction="sum", softcap=30.0)
    ref.backward()
    torch.testing.assert_close(loss, ref.float(), **tol)
    for a, b in zip((leaves[0].grad, leaves[1].grad), (ref_leaves[0].grad, ref_leaves[1].grad), strict=True):
        assert a.dtype == dtype
        assert (a.double() - b).norm() / b.norm() < tol["rtol"]
