"""slide_core/device.py and slide_core/devices: the default upload, the one warp-count rule and the
``--device auto`` rule. (The CUDA device's cap and streams are tested on a simulated build in tests/rocm; this
file is not test_device.py because that basename is tests/rocm's, and pytest needs them unique.)"""

from __future__ import annotations

import contextlib

import pytest
import torch

from slide_core.device import DeviceFacts, num_warps_for
from slide_core.devices import auto_device_name
from slide_core.devices.cpu import CPUDevice


class _RoleRecordingCPU(CPUDevice):
    def __init__(self) -> None:
        super().__init__()
        self.roles: list[str] = []

    def stream(self, role: str) -> contextlib.AbstractContextManager[None]:
        self.roles.append(role)
        return super().stream(role)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_to_device_copies_on_the_named_stream(dtype: torch.dtype) -> None:
    device = _RoleRecordingCPU()
    src = torch.randn(1000).to(dtype)
    dst = torch.empty_like(src)
    with device:
        assert device.copy_to_device(dst, src) is None
        device.copy_to_device(dst[:10], src[5:15], "d2h")
    assert torch.equal(dst[10:], src[10:]) and torch.equal(dst[:10], src[5:15])
    assert device.roles == ["h2d", "d2h"]


@pytest.mark.parametrize(
    ("block", "warp_size", "max_num_warps", "expected"),
    [
        (1, 32, 32, 1),
        (64, 32, 32, 2),  # as many warps as the block keeps busy
        (1024, 32, 32, 4),
        (2048, 32, 32, 8),
        (8192, 32, 32, 16),
        (32768, 32, 32, 32),
        (65536, 64, 16, 16),  # a HIP workgroup: 16 wavefronts of 64
        (96, 32, 32, 2),  # 3 would keep the block busy; Triton takes powers of two
    ],
)
def test_num_warps_for(block: int, warp_size: int, max_num_warps: int, expected: int) -> None:
    assert num_warps_for(block, warp_size=warp_size, max_num_warps=max_num_warps) == expected
    facts = DeviceFacts("gpu", "cuda", 1 << 30, 1, warp_size, max_num_warps)
    assert facts.num_warps(block) == expected


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_num_warps_for_refuses_a_non_block(bad: object) -> None:
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        num_warps_for(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("gpu", "hip", "expected"),
    [(False, None, "cpu"), (True, None, "cuda"), (True, "6.2", "rocm"), (False, "6.2", "cpu")],
)
def test_auto_device(monkeypatch: pytest.MonkeyPatch, gpu: bool, hip: str | None, expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert auto_device_name() == expected


def test_a_device_without_a_policy_leaves_the_run_its_own_defaults() -> None:
    """Device.preferred_* and doctor_facts default to no preference and nothing to say (a plugin with a
    policy, slide-rocm's, overrides them: tests/rocm/test_device.py)."""
    device = CPUDevice()
    assert device.preferred_activation_tier() is None
    assert device.preferred_attention() is None
    assert CPUDevice.doctor_facts() == {}
