"""The ROCm transfer rule is what the engine's parameter uploads run through (``Device.copy_to_device``).

The simulated HIP build (rocm_sim.py) makes "device" tensors host tensors, so a whole engine run on a
ROCm device is compared, loss for loss, with the CPU device, and the policy's decisions are observable:
a pageable master slab is refused by default and staged when the policy says so.
"""

from __future__ import annotations

import pytest
import torch
from rocm_sim import FakeGPU

from slide_core import AdamWConfig, HostParameters
from slide_core.devices.cpu import CPUDevice
from slide_core.engine import Engine, EngineConfig
from slide_core.optim import TorchAdamW
from slide_core.testing import ToyConfig, ToyModel, load_init, toy_batches, toy_init
from slide_rocm import PageableSourceError, ROCmDevice, ROCmPolicy
from slide_rocm.transfer import StagingBuffer

CONFIG = ToyConfig(num_layers=3)
STEPS = 3


class HostBackedROCmDevice(ROCmDevice):
    """The ROCm device with its "device" memory on the host, as the simulated build's tensors are."""

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")


def _train(device, *, steps: int = STEPS) -> list[float]:
    model = ToyModel(CONFIG)
    batches = toy_batches(CONFIG, steps, 1, batch=2, seq=8)
    # Chunks far smaller than a unit: every upload is several copy_to_device calls.
    config = EngineConfig(compute_dtype=torch.float32, transfer_chunk_numel=1024)
    with device:
        host = HostParameters(model)  # pageable: the engine pins the ranges it streams
        load_init(host, toy_init(model))
        with Engine(model, device, host, TorchAdamW(AdamWConfig(weight_decay=0.1)), config) as engine:
            return [engine.step(micro, lr=1e-3).loss for micro in batches]


@pytest.fixture(scope="module")
def cpu_losses() -> list[float]:
    return _train(CPUDevice())


def test_engine_uploads_go_through_the_rocm_policy(
    fake_hip: FakeGPU, cpu_losses: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[int] = []
    import slide_rocm.device as rocm_device

    real_check = rocm_device.check_h2d_source

    def check(tensor: torch.Tensor) -> None:
        checked.append(tensor.numel())
        real_check(tensor)

    monkeypatch.setattr(rocm_device, "check_h2d_source", check)
    device = HostBackedROCmDevice()
    assert _train(device) == cpu_losses
    # Every parameter byte uploaded was checked by the ROCm rule: each unit at least once per step.
    unit_numel = sum(unit.layout.numel for unit in ToyModel(CONFIG).units)
    assert sum(checked) >= STEPS * unit_numel
    assert len(checked) > len(ToyModel(CONFIG).units)  # chunked: more calls than units
    # The engine pinned the ranges it streams (so the rule let them through) and unpinned them at close.
    assert fake_hip.unregistered and not fake_hip.registered


def test_a_pageable_master_is_refused_by_the_engine_upload(fake_hip: FakeGPU) -> None:
    fake_hip.register_honoured = False  # hipHostRegister "succeeds" but the pages stay pageable
    with pytest.raises(PageableSourceError, match="refusing a host-to-device copy from pageable memory"):
        _train(HostBackedROCmDevice(), steps=1)  # the h2d thread's error, raised in the caller


def test_a_pageable_master_is_staged_when_the_policy_says_so(
    fake_hip: FakeGPU, cpu_losses: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hip.register_honoured = False
    staged: list[int] = []
    real_copy = StagingBuffer.copy

    def copy(self: StagingBuffer, dst: torch.Tensor, src: torch.Tensor, role: str):
        staged.append(src.numel())
        return real_copy(self, dst, src, role)

    monkeypatch.setattr(StagingBuffer, "copy", copy)
    device = HostBackedROCmDevice(policy=ROCmPolicy(stage_pageable=True, staging_bytes=4096))
    assert _train(device) == cpu_losses
    assert sum(staged) >= STEPS * sum(unit.layout.numel for unit in ToyModel(CONFIG).units)
