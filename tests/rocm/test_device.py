"""ROCmDevice on a simulated HIP build (see conftest.py), plus one real-hardware test marked ``rocm``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rocm_sim import H200, FakeGPU

from slide_core import plugins
from slide_core.devices.cuda import CUDADevice
from slide_rocm import (
    ATTENTION_FLASH,
    ATTENTION_SDPA,
    LaunchParams,
    PageableSourceError,
    ROCmDevice,
    ROCmPolicy,
    check_h2d_source,
)
from slide_rocm.device import ROCM_MAX_NUM_WARPS, ROCmFacts, is_rocm_build
from slide_rocm.launch import MAX_BLOCK_SIZE, launch_params_for

ROWS = [1, 7, 64, 100, 1000, 2048, 4096, 5000, 8192, 16384, 32768, 50000, 65536, 1 << 20]


# -- selection -------------------------------------------------------------------------------------------
def test_non_hip_build_is_not_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    assert is_rocm_build() is False


def test_simulated_hip_build_is_detected(fake_hip: FakeGPU) -> None:
    assert is_rocm_build() is True


def test_construct_on_cpu_build_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(RuntimeError, match=r"needs a ROCm \(HIP\) build of torch.*CPU only.*rocm6"):
        ROCmDevice()


def test_construct_on_cuda_build_fails_clearly(fake_cuda: FakeGPU) -> None:
    with pytest.raises(RuntimeError, match=r"built for CUDA 12\.8 \(torch\.version\.hip is not set\)"):
        ROCmDevice()
    CUDADevice()  # the same simulated machine is a fine CUDA device


def test_construct_on_hip_build(fake_hip: FakeGPU) -> None:
    device = ROCmDevice()
    assert device.backend == "rocm"
    assert device.torch_device == torch.device("cuda", 0)
    assert device.policy == ROCmPolicy()
    assert not device.is_open


def test_index_out_of_range_uses_the_cuda_check(fake_hip: FakeGPU) -> None:
    with pytest.raises(ValueError, match="out of range"):
        ROCmDevice(index=1)


def test_entry_point_finds_rocm_device() -> None:
    plugins._entry_points.cache_clear()
    assert "rocm" in plugins.available("slide.devices")
    cls = plugins.load("slide.devices", "rocm", CUDADevice)
    assert cls is ROCmDevice


# -- facts and launch parameters -------------------------------------------------------------------------
def test_facts_report_rocm_hardware(fake_hip: FakeGPU) -> None:
    facts = ROCmDevice().facts()
    assert isinstance(facts, ROCmFacts)
    assert facts.backend == "rocm"
    assert facts.name == "AMD Instinct MI300X"
    assert facts.total_memory_bytes == 192 * 2**30
    assert facts.multiprocessor_count == 304
    assert facts.warp_size == 64
    assert facts.max_num_warps == 16 == ROCM_MAX_NUM_WARPS
    assert facts.gfx_arch == "gfx942"
    assert facts.gcn_arch_name == "gfx942:sramecc+:xnack-"


def test_facts_default_wavefront_is_64(fake_hip: FakeGPU, monkeypatch: pytest.MonkeyPatch) -> None:
    bare = SimpleNamespace(name="AMD GPU", total_memory=2**30, multi_processor_count=60)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: bare)
    facts = ROCmDevice().facts()
    assert facts.warp_size == 64
    assert facts.gfx_arch == "" == facts.gcn_arch_name


def test_cuda_facts_allow_32_warps(fake_cuda: FakeGPU) -> None:
    facts = CUDADevice().facts()
    assert facts.backend == "cuda"
    assert facts.max_num_warps == 32
    assert facts.warp_size == 32


@pytest.mark.parametrize("row", ROWS)
def test_rocm_launch_never_exceeds_16_warps(fake_hip: FakeGPU, row: int) -> None:
    params = ROCmDevice().launch_params(row)
    assert isinstance(params, LaunchParams)
    assert 1 <= params.num_warps <= 16
    assert params.num_warps & (params.num_warps - 1) == 0
    assert params.num_warps * 64 <= 1024  # a HIP workgroup holds at most 1024 lanes
    assert params.block_size == min(1 << (row - 1).bit_length(), MAX_BLOCK_SIZE)


def test_cuda_path_would_use_32_warps_where_rocm_uses_16(fake_hip: FakeGPU, monkeypatch: pytest.MonkeyPatch) -> None:
    rocm = ROCmDevice()
    rocm_params = rocm.launch_params(65536)
    assert rocm_params == LaunchParams(num_warps=16, block_size=65536)

    monkeypatch.setattr(torch.version, "hip", None)
    cuda_facts = CUDADevice().facts()
    assert cuda_facts.max_num_warps == 32
    assert launch_params_for(cuda_facts, 65536) == LaunchParams(num_warps=32, block_size=65536)


def test_launch_params_for_short_and_medium_rows(fake_hip: FakeGPU) -> None:
    device = ROCmDevice()
    assert device.launch_params(64) == LaunchParams(num_warps=1, block_size=64)  # one wavefront is enough
    assert device.launch_params(1000) == LaunchParams(num_warps=4, block_size=1024)
    assert device.launch_params(4096) == LaunchParams(num_warps=8, block_size=4096)
    assert device.launch_params(8192) == LaunchParams(num_warps=16, block_size=8192)
    assert device.launch_params(10**7).block_size == MAX_BLOCK_SIZE  # capped; the kernel loops


@pytest.mark.parametrize("block", [1, 16, 64, 100, 1024, 2048, 8192, 32768, 65536])
def test_kernels_launch_with_the_devices_warp_rule(
    fake_hip: FakeGPU, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """One warp-count rule: slide-kernels' launchers pick, for this build's GPUs, what the device's facts
    say (slide_core.device.num_warps_for), on ROCm and on CUDA."""
    from slide_kernels._backend import num_warps_for

    assert num_warps_for(block) == ROCmDevice().facts().num_warps(block)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: H200)
    assert num_warps_for(block) == CUDADevice().facts().num_warps(block)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_launch_params_reject_bad_rows(fake_hip: FakeGPU, bad: object) -> None:
    with pytest.raises(ValueError, match="row_numel must be a positive int"):
        ROCmDevice().launch_params(bad)  # type: ignore[arg-type]


# -- pinned slabs ----------------------------------------------------------------------------------------
def test_power_of_two_slab_uses_the_pinned_allocator(fake_hip: FakeGPU) -> None:
    device = ROCmDevice()
    slab = device.alloc_pinned(1 << 20, torch.float32)
    assert slab.shape == (1 << 20,) and slab.dtype == torch.float32
    assert slab.is_pinned()
    assert fake_hip.pin_memory_calls == [4 << 20]
    assert fake_hip.registered == {}


def test_awkward_slab_registers_exact_bytes(fake_hip: FakeGPU) -> None:
    device = ROCmDevice().open()
    numel = (1 << 20) + 1  # rounding up to a power of two would nearly double it
    slab = device.alloc_pinned(numel, torch.bfloat16)
    assert slab.is_pinned()
    assert fake_hip.pin_memory_calls == []
    assert fake_hip.registered == {slab.data_ptr(): numel * 2}
    device.close()
    assert fake_hip.unregistered == [slab.data_ptr()]


def test_unhonoured_registration_falls_back_to_pinned_allocator(fake_hip: FakeGPU) -> None:
    fake_hip.register_honoured = False
    device = ROCmDevice()
    slab = device.alloc_pinned(3000, torch.float32)
    assert slab.is_pinned()
    assert fake_hip.pin_memory_calls == [12000]
    assert fake_hip.registered == {}
    assert device._registered == []


def test_empty_slab(fake_hip: FakeGPU) -> None:
    assert ROCmDevice().alloc_pinned(0, torch.float16).numel() == 0
    with pytest.raises(ValueError, match="numel >= 0"):
        ROCmDevice().alloc_pinned(-1, torch.float16)


# -- the transfer rule -----------------------------------------------------------------------------------
def test_check_h2d_source_refuses_pageable_and_names_the_size() -> None:
    pageable = torch.zeros(32, 32, dtype=torch.float32)  # a real, unpinned CPU tensor
    with pytest.raises(PageableSourceError) as info:
        check_h2d_source(pageable)
    message = str(info.value)
    assert "(32, 32) torch.float32 tensor of 4.00 KiB (4096 bytes)" in message
    assert "pageable" in message and "alloc_pinned" in message and "stage_pageable=True" in message
    assert isinstance(info.value, ValueError)


def test_pinned_source_is_copied_on_the_h2d_stream(fake_hip: FakeGPU) -> None:
    with ROCmDevice() as device:
        src = device.alloc_pinned(256, torch.float32)
        src.copy_(torch.arange(256, dtype=torch.float32))
        dst = torch.zeros(16, 16)  # stands in for device memory
        event = device.copy_to_device(dst, src)
        event.synchronize()
        assert torch.equal(dst.reshape(-1), src)
        assert fake_hip.streams_entered == [device._streams["h2d"]]


def test_pageable_source_is_refused_by_default(fake_hip: FakeGPU) -> None:
    with ROCmDevice() as device:
        dst = torch.zeros(1000)
        with pytest.raises(PageableSourceError, match=r"\(1000,\) torch.float32 tensor of 3.91 KiB \(4000 bytes\)"):
            device.copy_to_device(dst, torch.ones(1000))
        assert torch.equal(dst, torch.zeros(1000))
        assert fake_hip.streams_entered == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_pageable_source_is_staged_when_policy_says_so(fake_hip: FakeGPU, dtype: torch.dtype) -> None:
    policy = ROCmPolicy(stage_pageable=True, staging_bytes=128)  # two 64-byte halves: many chunks
    with ROCmDevice(policy=policy) as device:
        assert fake_hip.pin_memory_calls == [128]  # the staging slab, preallocated at open
        src = (torch.arange(1001) % 251).to(dtype)  # pageable, and not a multiple of the chunk size
        dst = torch.zeros(1001, dtype=dtype)
        device.copy_to_device(dst, src).synchronize()
        assert torch.equal(dst, src)
        chunks = -(-1001 * src.element_size() // 64)
        assert len(fake_hip.streams_entered) == chunks
        assert set(map(id, fake_hip.streams_entered)) == {id(device._streams["h2d"])}
    assert device._staging is None


def test_staging_waits_before_refilling_a_half(fake_hip: FakeGPU) -> None:
    with ROCmDevice(policy=ROCmPolicy(stage_pageable=True, staging_bytes=64)) as device:
        recorded = []
        record = device.record_event

        def spy(role: str, *, timing: bool = False) -> object:
            recorded.append(record(role, timing=timing))
            return recorded[-1]

        device.record_event = spy  # type: ignore[method-assign]
        device._staging._record_event = spy  # type: ignore[union-attr]
        src = torch.arange(40, dtype=torch.float32)  # 160 bytes: five 32-byte chunks, halves reused
        dst = torch.zeros(40)
        device.copy_to_device(dst, src)
        assert torch.equal(dst, src)
        waits = [event.event.synchronized for event in recorded]
        # chunks 0..2 were each waited on before their half was refilled; 3 and 4 are still in flight,
        # and the final event is the caller's.
        assert waits == [1, 1, 1, 0, 0, 0]


def test_staging_a_strided_pageable_source(fake_hip: FakeGPU) -> None:
    with ROCmDevice(policy=ROCmPolicy(stage_pageable=True, staging_bytes=64)) as device:
        src = torch.arange(200, dtype=torch.float32).reshape(10, 20).t()  # not contiguous
        dst = torch.zeros(20, 10)
        device.copy_to_device(dst, src)
        assert torch.equal(dst, src)


def test_copy_to_device_argument_errors(fake_hip: FakeGPU) -> None:
    device = ROCmDevice()
    pinned = device.alloc_pinned(64, torch.float32)
    with pytest.raises(RuntimeError, match="closed"):
        device.copy_to_device(torch.zeros(64), pinned)
    with device:
        with pytest.raises(ValueError, match="matching tensors"):
            device.copy_to_device(torch.zeros(63), pinned)
        with pytest.raises(ValueError, match="matching tensors"):
            device.copy_to_device(torch.zeros(64, dtype=torch.float16), pinned)
        with pytest.raises(ValueError, match="unknown stream role"):
            device.copy_to_device(torch.zeros(64), pinned, role="sideways")
        with pytest.raises(ValueError, match="contiguous src"):
            device.copy_to_device(torch.zeros(8, 4), pinned.reshape(4, 16)[:, ::2].t())
        with pytest.raises(ValueError, match="contiguous dst"):
            device.copy_to_device(torch.zeros(16, 4).t(), pinned)


# -- real hardware ---------------------------------------------------------------------------------------
@pytest.mark.rocm
@pytest.mark.skipif(
    not (is_rocm_build() and torch.cuda.is_available()), reason="needs an AMD GPU and a ROCm build of torch"
)
def test_real_h2d_copy_from_pinned_slab() -> None:
    numel = 3 * (1 << 20) + 5  # awkward size: exercises the exact-size registration path
    with ROCmDevice() as device:
        facts = device.facts()
        assert facts.backend == "rocm" and facts.gfx_arch.startswith("gfx")
        slab = device.alloc_pinned(numel, torch.float32)
        assert slab.is_pinned()
        slab.copy_(torch.randn(numel))
        dst = device.empty(numel, torch.float32)
        event = device.copy_to_device(dst, slab)
        device.wait_event("compute", event)
        assert torch.equal(dst.cpu(), slab)
        with pytest.raises(PageableSourceError):
            device.copy_to_device(dst, torch.ones(numel))


# -- memory cap ------------------------------------------------------------------------------------------
def test_a_capped_device_restores_the_cap_it_found(fake_cuda: FakeGPU) -> None:
    """Two capped devices in one process: closing the inner one leaves the outer one's cap in force, and
    closing the outer one restores what the process had before either."""
    total = 141 * 2**30
    fake_cuda.memory_fraction = 0.9  # set by someone else before either device
    with CUDADevice(memory_limit_bytes=total // 2):
        assert fake_cuda.memory_fraction == pytest.approx(0.5)
        with CUDADevice(memory_limit_bytes=total // 4):
            assert fake_cuda.memory_fraction == pytest.approx(0.25)
        assert fake_cuda.memory_fraction == pytest.approx(0.5)
    assert fake_cuda.memory_fraction == pytest.approx(0.9)


def test_an_uncapped_device_leaves_the_cap_alone(fake_cuda: FakeGPU) -> None:
    fake_cuda.memory_fraction = 0.3
    with CUDADevice():
        assert fake_cuda.memory_fraction == 0.3
    assert fake_cuda.memory_fraction == 0.3


# -- the policy reaching a run ---------------------------------------------------------------------------
def test_device_answers_its_policys_tier_and_attention(fake_hip: FakeGPU) -> None:
    """What slide-hf asks before its own defaults (Device.preferred_*): the policy's choices, in the names a
    run uses (a slide.tiers plugin, HF's attn_implementation)."""
    plain = ROCmDevice()
    assert plain.preferred_activation_tier() == "nvme"
    assert plain.preferred_attention() == "sdpa"
    flash = ROCmDevice(policy=ROCmPolicy(attention=ATTENTION_FLASH))
    assert flash.preferred_attention() == "flash_attention_2"


def test_doctor_facts_are_the_detected_policy(fake_hip: FakeGPU, no_flash_attn: None) -> None:
    facts = ROCmDevice.doctor_facts()
    assert facts == ROCmPolicy.detect().describe()
    assert facts["attention"] == ATTENTION_SDPA and facts["backend"] == "rocm"
