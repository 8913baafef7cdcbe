"""FusedAdamW (numba) against TorchAdamW(fused=False) and torch.optim.AdamW on the same flat tensors.

exp_avg / exp_avg_sq must match torch bit for bit (on AVX2/AVX512 torch builds, whose lerp/addcmul
kernels use the fused multiply-adds the kernel reproduces). The master may differ by an ulp of the
update, because torch's CPU ``sqrt`` is MKL's high-accuracy one, not the correctly rounded IEEE one;
against the same op sequence with an IEEE sqrt it must be bit-identical too.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from slide_core import AdamWConfig
from slide_core.optim import TorchAdamW, fused_adamw
from slide_core.optim.fused_adamw import FusedAdamW, best_adamw

pytest.importorskip("numba")

SIZES = (1, 7, 2049, 100_003)
LR = 1e-3
STEPS = 4
RTOL = 1e-6
FMA_BUILD = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    FusedAdamW(AdamWConfig()).warmup()  # compile once (a few seconds cold, <1 s from numba's cache)


def _state(n: int, seed: int, zeros: bool = False):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    if zeros:  # torch.optim.AdamW starts its moments at zero
        return master, torch.zeros(n), torch.zeros(n)
    exp_avg = torch.randn(n, generator=gen).mul_(0.1)
    exp_avg_sq = torch.rand(n, generator=gen).mul_(0.01).add_(1e-6)
    return master, exp_avg, exp_avg_sq


def _grads(n: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed + 1000)
    return [torch.randn(n, generator=gen).add_(0.01).to(dtype) for _ in range(STEPS)]


def _clone(*ts):
    return [t.clone() for t in ts]


def _assert_master_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # one ulp of the update (~lr) plus an ulp of the master: well inside RTOL
    torch.testing.assert_close(got, want, rtol=RTOL, atol=LR * RTOL)


def _assert_moments(got_m, got_v, want_m, want_v) -> None:
    if FMA_BUILD:
        assert torch.equal(got_m, want_m)
        assert torch.equal(got_v, want_v)
    else:
        torch.testing.assert_close(got_m, want_m, rtol=RTOL, atol=0)
        torch.testing.assert_close(got_v, want_v, rtol=RTOL, atol=0)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # lerp weight < 0.5 and >= 0.5 take different formulas
def test_matches_torch_adamw_unfused(n, grad_dtype, beta1):
    config = AdamWConfig(beta1=beta1, weight_decay=0.1)
    master, exp_avg, exp_avg_sq = _state(n, seed=n)
    ref = _clone(master, exp_avg, exp_avg_sq)
    fused, torch_opt = FusedAdamW(config), TorchAdamW(config, fused=False)
    for step, grad in enumerate(_grads(n, grad_dtype, seed=n), start=1):
        decay = step != 2  # decay on and off across steps
        fused.step(master, grad, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, lr=LR, step=step, decay=decay)
        torch_opt.step(ref[0], grad, {"exp_avg": ref[1], "exp_avg_sq": ref[2]}, lr=LR, step=step, decay=decay)
    _assert_moments(exp_avg, exp_avg_sq, ref[1], ref[2])
    _assert_master_close(master, ref[0])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_matches_torch_optim_adamw(n, grad_dtype, weight_decay):
    config = AdamWConfig(weight_decay=0.1)  # decay=False below must ignore it entirely
    master, exp_avg, exp_avg_sq = _state(n, seed=7 * n, zeros=True)
    param = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([param], lr=LR, weight_decay=weight_decay, foreach=False, fused=False)
    fused = FusedAdamW(AdamWConfig(weight_decay=weight_decay) if weight_decay else config)
    for step, grad in enumerate(_grads(n, grad_dtype, seed=7 * n), start=1):
        param.grad = grad.float()
        opt.step()
        state = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        fused.step(master, grad, state, lr=LR, step=step, decay=bool(weight_decay))
    ref = opt.state[param]
    _assert_moments(exp_avg, exp_avg_sq, ref["exp_avg"], ref["exp_avg_sq"])
    _assert_master_close(master, param.detach())


def _reference_ieee_sqrt(master, grad, exp_avg, exp_avg_sq, config: AdamWConfig, step: int) -> None:
    """torch.optim.AdamW's single-tensor ops, with the one non-IEEE op (MKL's sqrt) made IEEE."""
    g = grad.float()
    if config.weight_decay:
        master.mul_(1 - LR * config.weight_decay)
    exp_avg.lerp_(g, 1 - config.beta1)
    exp_avg_sq.mul_(config.beta2).addcmul_(g, g, value=1 - config.beta2)
    bias_correction1 = 1 - config.beta1**step
    bias_correction2_sqrt = (1 - config.beta2**step) ** 0.5
    sqrt = torch.from_numpy(np.sqrt(exp_avg_sq.numpy()))
    denom = (sqrt / bias_correction2_sqrt).add_(config.eps)
    master.addcdiv_(exp_avg, denom, value=-(LR / bias_correction1))


@pytest.mark.skipif(not FMA_BUILD, reason="torch's lerp/addcmul round differently without FMA")
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_bit_exact_with_ieee_sqrt(grad_dtype, beta1):
    n = 100_003
    config = AdamWConfig(beta1=beta1, weight_decay=0.1)
    master, exp_avg, exp_avg_sq = _state(n, seed=3)
    ref = _clone(master, exp_avg, exp_avg_sq)
    fused = FusedAdamW(config)
    for step, grad in enumerate(_grads(n, grad_dtype, seed=3), start=1):
        fused.step(master, grad, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, lr=LR, step=step, decay=True)
        _reference_ieee_sqrt(*ref[:1], grad, *ref[1:], config, step)
    assert torch.equal(master, ref[0])
    assert torch.equal(exp_avg, ref[1])
    assert torch.equal(exp_avg_sq, ref[2])


def test_updates_only_its_range_of_a_larger_buffer():
    config = AdamWConfig(weight_decay=0.1)
    master, exp_avg, exp_avg_sq = _state(10_000, seed=11)
    before = _clone(master, exp_avg, exp_avg_sq)
    grad = _grads(10_000, torch.bfloat16, seed=11)[0]
    lo, hi = 1_234, 7_777  # an engine-style view at an odd offset
    FusedAdamW(config).step(
        master[lo:hi],
        grad[lo:hi],
        {"exp_avg": exp_avg[lo:hi], "exp_avg_sq": exp_avg_sq[lo:hi]},
        lr=LR,
        step=1,
        decay=True,
    )
    ref = [t[lo:hi].clone() for t in before]
    TorchAdamW(config, fused=False).step(
        ref[0], grad[lo:hi], {"exp_avg": ref[1], "exp_avg_sq": ref[2]}, lr=LR, step=1, decay=True
    )
    for got, old, want in zip((master, exp_avg, exp_avg_sq), before, ref, strict=True):
        assert torch.equal(got[:lo], old[:lo]) and torch.equal(got[hi:], old[hi:])
        torch.testing.assert_close(got[lo:hi], want, rtol=RTOL, atol=LR * RTOL)


def test_thread_count_does_not_change_results():
    n = 50_001
    config = AdamWConfig(weight_decay=0.1)
    results = []
    for threads in (1, None):
        master, exp_avg, exp_avg_sq = _state(n, seed=5)
        opt = FusedAdamW(config, threads=threads)
        for step, grad in enumerate(_grads(n, torch.bfloat16, seed=5), start=1):
            opt.step(master, grad, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, lr=LR, step=step, decay=True)
        results.append((master, exp_avg, exp_avg_sq))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_rejects_bad_ranges_and_skips_empty():
    opt = FusedAdamW(AdamWConfig())
    empty = torch.empty(0)
    opt.step(empty, empty.bfloat16(), {"exp_avg": empty, "exp_avg_sq": empty}, lr=LR, step=1, decay=True)
    x = torch.ones(8)
    with pytest.raises(ValueError, match="sizes differ"):
        opt.step(x, torch.ones(7), {"exp_avg": x.clone(), "exp_avg_sq": x.clone()}, lr=LR, step=1, decay=True)
    strided = torch.ones(16)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        opt.step(strided, torch.ones(8), {"exp_avg": x.clone(), "exp_avg_sq": x.clone()}, lr=LR, step=1, decay=True)
    with pytest.raises(ValueError, match="threads"):
        FusedAdamW(AdamWConfig(), threads=0)


def test_best_adamw_picks_by_numba(monkeypatch):
    assert FusedAdamW.available()
    assert isinstance(best_adamw(AdamWConfig()), FusedAdamW)
    monkeypatch.setattr(fused_adamw, "_numba_available", lambda: False)
    assert not FusedAdamW.available()
    assert isinstance(best_adamw(AdamWConfig()), TorchAdamW)


@pytest.mark.slow  # a fresh Python process: seconds of imports
def test_importing_slide_core_does_not_import_numba():
    code = (
        "import sys, slide_core, slide_core.optim, slide_core.optim.fused_adamw; "
        "assert 'numba' not in sys.modules, 'numba imported at import time'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kind", ["undo", "rescale"])
@pytest.mark.parametrize("step", [1, 4])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_fused_correction_matches_the_torch_correction(kind: str, step: int, grad_dtype: torch.dtype) -> None:
    """Clipping's one-pass correction (fused_correct) against AdamWCorrection's torch ops."""
    pytest.importorskip("numba")
    from slide_core.engine.clipping import AdamWCorrection, Correction

    config = AdamWConfig(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    generator = torch.Generator().manual_seed(step)
    n = 10_007
    grad = torch.randn(n, generator=generator).to(grad_dtype)
    start = (
        torch.randn(n, generator=generator),
        torch.randn(n, generator=generator) * 1e-2,
        torch.rand(n, generator=generator) * 1e-3,
    )
    results = []
    for fused in (False, True):
        p, m, v = (t.clone() for t in start)
        correction = Correction(kind, 0.25) if kind == "rescale" else Correction("undo")
        AdamWCorrection(config, 4096, use_fused=fused).apply(
            correction, p, grad, 0.8, {"exp_avg": m, "exp_avg_sq": v}, lr=1e-3, step=step, decay=True
        )
        results.append((p, m, v))
    for want, got in zip(*results, strict=True):
        # Both take an update back arithmetically, so they agree to rounding, not bit for bit.
        assert (got - want).norm() <= 1e-6 * want.norm()


GRAD_SCALE = 0.3712345678901  # not an fp32: both paths must round it to fp32 before multiplying


def _pre_scaled(grad: torch.Tensor) -> torch.Tensor:
    """The fp32 ``c * g`` that clipping's speculative updates applied before ``grad_scale`` existed."""
    from slide_core.engine.clipping import scale_into

    return scale_into(torch.empty(grad.numel()), grad, GRAD_SCALE)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("step", [1, 5])
def test_grad_scale_is_the_pre_scaled_step(n, grad_dtype, decay, step):
    """``grad_scale=c`` on the raw gradient, scaled in registers, against a step on ``scale_into``'s fp32
    ``c * g``: bit for bit against FusedAdamW itself, and as close to TorchAdamW as the unscaled tests ask
    (moments bit for bit on FMA builds, master to an ulp of the update: MKL's sqrt)."""
    config = AdamWConfig(weight_decay=0.1)
    start = _state(n, seed=n + step, zeros=step == 1)
    grad = _grads(n, grad_dtype, seed=n + step)[0]
    before = grad.clone()
    scaled = _pre_scaled(grad)
    results = []
    for opt, g, scale in (
        (FusedAdamW(config), grad, GRAD_SCALE),
        (FusedAdamW(config), scaled, 1.0),
        (TorchAdamW(config, fused=False), scaled, 1.0),
    ):
        master, exp_avg, exp_avg_sq = _clone(*start)
        state = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        opt.step(master, g, state, lr=LR, step=step, decay=decay, grad_scale=scale)
        results.append((master, exp_avg, exp_avg_sq))
    assert torch.equal(grad, before), "grad_scale wrote the caller's gradient"
    (got, pre_scaled, torch_ref) = results
    for a, b in zip(got, pre_scaled, strict=True):
        assert torch.equal(a, b)
    _assert_moments(got[1], got[2], torch_ref[1], torch_ref[2])
    _assert_master_close(got[0], torch_ref[0])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("step", [1, 5])
def test_torch_adamw_grad_scale_is_the_pre_scaled_step(fused, grad_dtype, step):
    """TorchAdamW forms ``c * g`` in its cast scratch exactly as ``scale_into`` does: bit for bit."""
    if fused and not hasattr(torch, "_fused_adamw_"):
        pytest.skip("this torch build has no _fused_adamw_")
    n = 100_003
    config = AdamWConfig(weight_decay=0.1)
    start = _state(n, seed=step, zeros=step == 1)
    grad = _grads(n, grad_dtype, seed=step)[0]
    before = grad.clone()
    results = []
    for g, scale in ((grad, GRAD_SCALE), (_pre_scaled(grad), 1.0)):
        master, exp_avg, exp_avg_sq = _clone(*start)
        opt = TorchAdamW(config, fused=fused)
        opt.step(
            master, g, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, lr=LR, step=step, decay=True, grad_scale=scale
        )
        results.append((master, exp_avg, exp_avg_sq))
    assert torch.equal(grad, before), "grad_scale wrote the caller's gradient"
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_grad_scale_reaches_the_device_fallback(monkeypatch):
    """A range off the host goes through TorchAdamW, which must get the scale too."""
    opt = FusedAdamW(AdamWConfig())
    seen = {}
    monkeypatch.setattr(TorchAdamW, "step", lambda self, *args, **kwargs: seen.update(kwargs))
    meta = torch.empty(8, device="meta")
    opt.step(meta, meta, {"exp_avg": meta, "exp_avg_sq": meta}, lr=LR, step=1, decay=True, grad_scale=0.5)
    assert seen["grad_scale"] == 0.5
