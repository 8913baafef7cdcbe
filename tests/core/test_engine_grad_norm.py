"""``StepResult.grad_norm`` on every step, against ``torch.nn.utils.get_total_norm`` over plain PyTorch's
gradients, on the CPU device in fp32. See Note [Gradient norm of every step] in docs/design/engine.md
(clipping's norms are checked in test_engine_clipping.py)."""

from __future__ import annotations

import math

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyBlock, ToyConfig, ToyModel, load_init, reference_loss, toy_batches, toy_init
from slide_core.tiers.host_ram import HostRamTier

RTOL = 1e-5
LR = 3e-3

CASES = {
    # name: (tied, accum, resident_units, offloaded_units)
    "untied": (False, 1, (), ()),
    "tied": (True, 1, (), ()),  # the embedding's two shares are summed on the host
    "accum2": (False, 2, (), ()),
    "tied-accum3": (True, 3, (), ()),
    "tied-resident-embedding": (True, 1, ("embed",), ()),  # summed in its device slot
    "accum2-resident": (False, 2, ("embed", "layers.1", "head"), ()),  # device fp32 accumulators
    "tied-accum2-mixed": (True, 2, ("layers.0",), ("embed", "layers.2")),
}


def _reference_norms(model: ToyModel, init, batches) -> tuple[list[float], list[float]]:
    """Losses and total gradient norms of plain autograd + torch.optim.AdamW, step by step."""
    params = {unit: {name: torch.nn.Parameter(t.clone()) for name, t in views.items()} for unit, views in init.items()}
    flat = [p for views in params.values() for p in views.values()]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in flat if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in flat if p.dim() < 2]},
        ],
        lr=LR,
        weight_decay=0.0,
    )
    losses, norms = [], []
    for micro in batches:
        tokens = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
        total = 0.0
        for ids, labels in micro:
            loss = reference_loss(model, params, ids, labels)
            (loss / tokens).backward()
            total += loss.item()
        losses.append(total / tokens)
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in flat])))
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms


def _engine_results(model: ToyModel, init, batches, config: EngineConfig, state_tier=None):
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        load_init(host, init)
        optimizer = TorchAdamW(AdamWConfig(weight_decay=0.1))
        with Engine(model, device, host, optimizer, config, state_tier=state_tier) as engine:
            return [engine.step(micro, lr=LR) for micro in batches]


@pytest.mark.parametrize("skip_nonfinite", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_grad_norm_matches_get_total_norm(case: str, skip_nonfinite: bool) -> None:
    tied, accum, resident, offloaded = CASES[case]
    cfg = ToyConfig(tie_embeddings=tied, num_layers=3)
    model = ToyModel(cfg)
    init = toy_init(model, seed=9)
    batches = toy_batches(cfg, steps=3, accum=accum, seed=10)
    config = EngineConfig(
        compute_dtype=torch.float32,
        transfer_chunk_numel=1024,
        resident_units=resident,
        offloaded_units=offloaded,
        skip_nonfinite=skip_nonfinite,
    )
    with HostRamTier() as tier:
        results = _engine_results(model, init, batches, config, tier if offloaded else None)
    losses, norms = _reference_norms(model, init, batches)
    for step, result in enumerate(results):
        assert result.loss == pytest.approx(losses[step], rel=RTOL), f"loss differs at step {step + 1}"
        assert result.grad_norm == pytest.approx(norms[step], rel=RTOL), f"grad norm differs at step {step + 1}"


def test_grad_norm_can_be_turned_off() -> None:
    """``report_grad_norm=False`` without clipping: no norm (nor any wait for host sums); clipping still
    reports its own."""
    cfg = ToyConfig(tie_embeddings=True, num_layers=2)
    model = ToyModel(cfg)
    init = toy_init(model, seed=1)
    batches = toy_batches(cfg, steps=2, accum=2, seed=2)
    base = dict(compute_dtype=torch.float32, transfer_chunk_numel=1024, report_grad_norm=False)
    assert all(r.grad_norm is None for r in _engine_results(model, init, batches, EngineConfig(**base)))
    _, norms = _reference_norms(model, init, batches[:1])
    clipped = _engine_results(model, init, batches[:1], EngineConfig(**base, max_grad_norm=1e6))
    assert clipped[0].grad_norm == pytest.approx(norms[0], rel=RTOL)


class _NaNGrad(torch.autograd.Function):
    """Identity forward; NaN backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("nan"))


class _NaNBlock(ToyBlock):
    def forward(self, params, x, inputs):
        y = super().forward(params, x, inputs)
        return _NaNGrad.apply(y) if torch.is_grad_enabled() else y


@pytest.mark.parametrize("resident", [(), ("embed", "layers.0")])
def test_reported_norm_never_stops_the_engine(resident: tuple[str, ...]) -> None:
    """With ``skip_nonfinite=False`` non-finite gradients are applied as they are: the reported norm
    shows them (NaN) and does not turn on the engine's non-finite checks."""
    cfg = ToyConfig(tie_embeddings=True, num_layers=2)
    model = ToyModel(cfg)
    model.blocks[1] = _NaNBlock(cfg, 1)
    batches = toy_batches(cfg, steps=1, accum=2, seed=3)
    config = EngineConfig(
        compute_dtype=torch.float32, transfer_chunk_numel=1024, skip_nonfinite=False, resident_units=resident
    )
    (result,) = _engine_results(model, toy_init(model), batches, config)
    assert math.isnan(result.grad_norm)
