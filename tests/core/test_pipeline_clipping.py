"""Clipping through the optimizer interface: ``Optimizer.correct`` for both shipped AdamW optimizers, and an
optimizer that is not AdamW clipped exactly by the engine (its only contribution to clipping being
``correct``), on the CPU device in fp32.

See "Clipping" in docs/design/engine.md and slide_core/engine/clip_strategy.py.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from slide_core import AdamWConfig, HostParameters, Optimizer
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.optimizer import Coefficient, Correction, scale_into
from slide_core.testing import ToyConfig, ToyModel, load_init, reference_loss, toy_batches, toy_init

RTOL = 1e-5
LR = 0.05


class _SGD(Optimizer):
    """Plain SGD (``p -= lr * g``, no momentum, no weight decay): no state, and nothing of AdamW."""

    state_names = ()

    def step(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float = 1.0,
    ) -> None:
        master.add_(scale_into(torch.empty_like(master), grad, grad_scale), alpha=-lr)

    def correct(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        applied: Coefficient,
        correction: Correction,
        lr: float,
        step: int,
        decay: bool,
    ) -> None:
        if correction.kind == "keep":
            return
        scratch = torch.empty_like(master)
        master.add_(scale_into(scratch, grad, applied), alpha=lr)
        if correction.kind == "rescale":
            master.add_(scale_into(scratch, grad, correction.coeff), alpha=-lr)


class _SGDWithoutCorrection(Optimizer):
    state_names = ()

    def step(self, master, grad, state, *, lr, step, decay, grad_scale=1.0) -> None:
        master.add_(scale_into(torch.empty_like(master), grad, grad_scale), alpha=-lr)


def _reference(model, init, batches, max_norm: float) -> tuple[list[float], list[float], dict]:
    """Plain autograd + clip_grad_norm_ + torch.optim.SGD."""
    params = {unit: {name: torch.nn.Parameter(t.clone()) for name, t in views.items()} for unit, views in init.items()}
    flat = [p for views in params.values() for p in views.values()]
    optimizer = torch.optim.SGD(flat, lr=LR)
    losses, norms = [], []
    for micro in batches:
        tokens = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
        total = 0.0
        for ids, labels in micro:
            loss = reference_loss(model, params, ids, labels)
            (loss / tokens).backward()
            total += loss.item()
        losses.append(total / tokens)
        norms.append(float(torch.nn.utils.clip_grad_norm_(flat, max_norm)))
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms, params


@pytest.mark.parametrize("regime", ["clips", "never"])
@pytest.mark.parametrize(
    ("tied", "accum", "resident"), [(False, 1, ()), (True, 2, ()), (True, 1, ("embed",)), (False, 2, ("layers.1",))]
)
def test_clipping_a_non_adamw_optimizer_matches_clip_grad_norm(
    tied: bool, accum: int, resident: tuple[str, ...], regime: str
) -> None:
    """Speculated, corrected and (after a clipped step) deferred updates of an SGD optimizer equal
    ``clip_grad_norm_`` + ``torch.optim.SGD``: the strategies know nothing of the optimizer's arithmetic."""
    cfg = ToyConfig(tie_embeddings=tied, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=4)
    batches = toy_batches(cfg, steps=4, accum=accum, seed=12)
    max_norm = 0.05 if regime == "clips" else 1e6
    ref_losses, ref_norms, ref_params = _reference(model, init, batches, max_norm)
    assert all((norm > max_norm) == (regime == "clips") for norm in ref_norms), "test setup: wrong regime"
    config = EngineConfig(
        compute_dtype=torch.float32, transfer_chunk_numel=1024, resident_units=resident, max_grad_norm=max_norm
    )
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, init)
        with Engine(model, device, host, _SGD(AdamWConfig()), config) as engine:
            results = [engine.step(micro, lr=LR) for micro in batches]
    for step, result in enumerate(results):
        assert result.loss == pytest.approx(ref_losses[step], rel=RTOL), f"loss differs at step {step + 1}"
        assert result.grad_norm == pytest.approx(ref_norms[step], rel=RTOL), f"norm differs at step {step + 1}"
    for unit, views in ref_params.items():
        for name, want in views.items():
            got = host.views(unit)[name]
            err = float((got - want.detach()).norm() / want.detach().norm())
            assert err <= RTOL, f"{unit}.{name} differs: relative error {err:.2e}"


def test_an_optimizer_that_cannot_correct_runs_only_unclipped() -> None:
    model = ToyModel(ToyConfig(num_layers=2))
    optimizer = _SGDWithoutCorrection(AdamWConfig())
    assert not optimizer.corrects and _SGD(AdamWConfig()).corrects and TorchAdamW(AdamWConfig()).corrects
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        with pytest.raises(ValueError, match="_SGDWithoutCorrection cannot"):
            Engine(model, device, host, optimizer, EngineConfig(max_grad_norm=1.0))
        Engine(model, device, host, optimizer, EngineConfig(compute_dtype=torch.float32))  # clipping off: fine


def _adamw_optimizers() -> list[str]:
    from slide_core.optim.fused_adamw import FusedAdamW

    return ["torch", "fused"] if FusedAdamW.available() else ["torch"]


def _make(kind: str, config: AdamWConfig) -> Optimizer:
    if kind == "fused":
        from slide_core.optim.fused_adamw import FusedAdamW

        return FusedAdamW(config, threads=1)
    return TorchAdamW(config)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", _adamw_optimizers())
@pytest.mark.parametrize("step", [1, 3])
def test_adamw_correct_undoes_and_rescales_its_own_step(kind: str, step: int, grad_dtype: torch.dtype) -> None:
    """``correct`` after ``step(grad_scale=a)``: ``undo`` gives back the state before it, ``rescale`` the
    state a step with ``c * g`` would have left, to rounding (the first step's moments exactly zero)."""
    config = AdamWConfig(beta1=0.9, beta2=0.95, weight_decay=0.1)
    generator = torch.Generator().manual_seed(step)
    n = 5000
    grad = torch.randn(n, generator=generator).to(grad_dtype)
    zeros = step == 1
    start = {
        "master": torch.randn(n, generator=generator),
        # Moments of a gradient of this scale (as after earlier steps): the undo's rounding is then not
        # amplified by a tiny v (see 'Why c_u rather than 1' in docs/design/engine.md).
        "exp_avg": torch.zeros(n) if zeros else torch.randn(n, generator=generator) * 0.1,
        "exp_avg_sq": torch.zeros(n) if zeros else torch.rand(n, generator=generator) + 0.5,
    }
    applied, final = 0.75, 0.2
    results = {}
    for correction in (Correction("undo"), Correction("rescale", final)):
        arrays = {name: tensor.clone() for name, tensor in start.items()}
        state = {name: arrays[name] for name in ("exp_avg", "exp_avg_sq")}
        optimizer = _make(kind, config)
        optimizer.step(arrays["master"], grad, state, lr=1e-2, step=step, decay=True, grad_scale=applied)
        optimizer.correct(
            arrays["master"], grad, state, applied=applied, correction=correction, lr=1e-2, step=step, decay=True
        )
        results[correction.kind] = arrays
    redone = {name: tensor.clone() for name, tensor in start.items()}
    state = {name: redone[name] for name in ("exp_avg", "exp_avg_sq")}
    _make(kind, config).step(redone["master"], grad, state, lr=1e-2, step=step, decay=True, grad_scale=final)
    for want, got in ((start, results["undo"]), (redone, results["rescale"])):
        for name, tensor in want.items():
            if zeros and name != "master" and got is results["undo"]:
                assert not got[name].any(), name
                continue
            assert float((got[name] - tensor).norm()) <= 1e-6 * float(tensor.norm()), name
