"""The fused loss writes the head matrix's gradient straight into the engine's slot (Unit.grads_in_forward).

The in-place path must change nothing but memory: the same run with the copy path (``grads_in_forward``
forced empty) gives bit-identical losses and weights, untied and tied, with accumulation, with device-
resident head/embedding units and with clipping's speculative updates.
"""

from __future__ import annotations

import pytest
import torch

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.engine.host_pipeline import HostPipeline
from slide_core.engine.resident_pipeline import ResidentPipeline
from slide_core.optim import TorchAdamW
from slide_core.unit import UnitRole
from slide_hf import PRESETS, build_model
from slide_hf.adapters.base import HeadUnit

pytest.importorskip("slide_kernels")


def _batches(vocab: int, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(2):
            ids = torch.randint(0, vocab, (2, 10), generator=generator)
            labels = ids.clone()
            labels[0, :3] = -100
            micro.append((ids, labels))
        out.append(micro)
    return out


def _train(preset: str, engine_config: EngineConfig) -> tuple[list[float], torch.Tensor]:
    config = PRESETS[preset]()
    config._attn_implementation = "eager"
    model = build_model(config)
    with CPUDevice() as device:
        host = HostParameters(model, device.alloc_pinned)
        generator = torch.Generator().manual_seed(0)
        host.slab.copy_(torch.randn(host.slab.shape, generator=generator) * 0.05)
        batches = _batches(config.vocab_size, 3)
        with Engine(model, device, host, TorchAdamW(AdamWConfig(weight_decay=0.1)), engine_config) as engine:
            losses = [engine.step(micro, 2e-3).loss for micro in batches]
        return losses, host.slab.clone()


@pytest.mark.parametrize("preset", ["test-llama", "test-llama-untied"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"resident_units": ("embedding", "head")},
        {"max_grad_norm": 0.05},
        {"resident_units": ("embedding", "head"), "max_grad_norm": 0.05},
    ],
    ids=["host", "resident", "clipped", "resident-clipped"],
)
def test_gradient_written_in_place_matches_copy(preset: str, options: dict, monkeypatch) -> None:
    engine_config = EngineConfig(block_slots=2, compute_dtype=torch.float32, transfer_chunk_numel=4096, **options)
    seen: list[bool] = []
    forward_into = HeadUnit.forward_into

    def spy(self, params, x, inputs, grad_into):
        seen.append(bool(grad_into))
        return forward_into(self, params, x, inputs, grad_into)

    in_place_grads: list[bool] = []

    def spying(contribute):
        def spy_contribute(self, unit, slot, grads, contribution, ctx):
            for name, view in unit.layout.views(slot.grads).items():
                grad = grads.get(name)
                if grad is not None and unit.role is not UnitRole.BLOCK and view.numel() > 1000:
                    in_place_grads.append(grad.data_ptr() == view.data_ptr())
            return contribute(self, unit, slot, grads, contribution, ctx)

        return spy_contribute

    monkeypatch.setattr(HeadUnit, "forward_into", spy)
    for pipeline in (HostPipeline, ResidentPipeline):  # where a unit's gradients enter its pipeline
        monkeypatch.setattr(pipeline, "contribute", spying(pipeline.contribute))
    in_place = _train(preset, engine_config)
    assert seen and all(seen), "the head was never given the slot's gradient buffer"
    assert True in in_place_grads, "autograd did not hand back the slot's buffer as the head's gradient"

    monkeypatch.setattr(HeadUnit, "grads_in_forward", property(lambda self: frozenset()))
    seen.clear()
    copied = _train(preset, engine_config)
    assert seen and not any(seen)

    assert in_place[0] == copied[0]
    assert torch.equal(in_place[1], copied[1])
