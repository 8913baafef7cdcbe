"""ROCmPolicy: transfer rule, NVMe tier choice, attention backend and ``describe()``."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from rocm_sim import FakeGPU

from slide_rocm import ATTENTION_FLASH, ATTENTION_SDPA, ROCmPolicy
from slide_rocm.hip import HIPFILE_MODULES, gcn_arch_name, hip_version, probe_module
from slide_rocm.policy import EXPERIMENTAL_TIERS, NVME_TIERS


def test_defaults_are_conservative(no_hipfile: None) -> None:
    policy = ROCmPolicy()
    assert policy.stage_pageable is False
    assert policy.transfer_rule == "pinned-only"
    assert policy.nvme_tier == "nvme"
    assert policy.nvme_tier_experimental is False
    assert policy.attention == ATTENTION_SDPA == "sdpa (AOTriton)"


def test_policy_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ROCmPolicy().stage_pageable = True  # type: ignore[misc]


def test_stage_rule() -> None:
    assert ROCmPolicy(stage_pageable=True).transfer_rule == "stage"


@pytest.mark.parametrize("tier", ["gds", "kvikio", "cufile"])
def test_gds_is_never_an_amd_tier(tier: str) -> None:
    assert tier not in NVME_TIERS
    with pytest.raises(ValueError, match=r"NVIDIA-only; on AMD use 'nvme' \(POSIX\)"):
        ROCmPolicy(nvme_tier=tier)


def test_unknown_tier_and_attention_are_refused() -> None:
    with pytest.raises(ValueError, match="nvme_tier must be one of"):
        ROCmPolicy(nvme_tier="tape")
    with pytest.raises(ValueError, match="attention must be"):
        ROCmPolicy(attention="xformers")


@pytest.mark.parametrize(("field", "value"), [("staging_bytes", 1), ("pinned_round_up_max_waste", 1.5)])
def test_numeric_fields_are_checked(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ROCmPolicy(**{field: value})


def test_hipfile_needs_bindings(no_hipfile: None) -> None:
    assert probe_module(HIPFILE_MODULES) is None
    with pytest.raises(ValueError, match=r"needs AMD hipFile Python bindings \(tried hipfile, rocm.hipfile\)"):
        ROCmPolicy(nvme_tier="hipfile")


def test_hipfile_allowed_and_experimental_with_bindings(fake_hipfile: ModuleType) -> None:
    policy = ROCmPolicy(nvme_tier="hipfile")
    assert policy.nvme_tier_experimental is True
    assert "hipfile" in EXPERIMENTAL_TIERS


def test_detect_keeps_nvme_unless_hipfile_asked_for_and_importable(fake_hip: FakeGPU, no_hipfile: None) -> None:
    assert ROCmPolicy.detect().nvme_tier == "nvme"
    assert ROCmPolicy.detect(prefer_hipfile=True).nvme_tier == "nvme"  # asked for, but not installed


def test_detect_picks_hipfile_only_on_request(fake_hip: FakeGPU, fake_hipfile: ModuleType) -> None:
    assert ROCmPolicy.detect().nvme_tier == "nvme"  # experimental: opt-in
    chosen = ROCmPolicy.detect(prefer_hipfile=True, stage_pageable=True)
    assert chosen.nvme_tier == "hipfile" and chosen.nvme_tier_experimental
    assert chosen.stage_pageable is True


def test_detect_attention_flash_on_hip_build(fake_hip: FakeGPU, fake_flash_attn: None) -> None:
    assert ROCmPolicy.detect().attention == ATTENTION_FLASH == "flash-attn (ROCm build)"


def test_detect_attention_sdpa_without_flash_attn(fake_hip: FakeGPU, no_flash_attn: None) -> None:
    assert ROCmPolicy.detect().attention == ATTENTION_SDPA


def test_detect_attention_ignores_flash_attn_off_hip(fake_cuda: FakeGPU, fake_flash_attn: None) -> None:
    # A CUDA build's flash_attn is not the ROCm build; the ROCm policy does not claim it.
    assert ROCmPolicy.detect().attention == ATTENTION_SDPA


def test_probe_module_returns_first_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "slide_rocm_present_probe", ModuleType("slide_rocm_present_probe"))
    assert probe_module(["slide_rocm_absent_probe", "slide_rocm_present_probe"]) == "slide_rocm_present_probe"
    assert probe_module(["slide_rocm_absent_probe"]) is None


def test_probe_module_does_not_hide_broken_installs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "slide_rocm_broken_probe.py").write_text("raise ZeroDivisionError('broken install')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ZeroDivisionError):
        probe_module(["slide_rocm_broken_probe"])


def test_describe_on_simulated_mi300x(fake_hip: FakeGPU, no_hipfile: None) -> None:
    lines = ROCmPolicy().describe()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in lines.items())
    assert lines["backend"] == "rocm"
    assert lines["hip_version"] == "6.2.41133"
    assert lines["gfx_arch"] == "gfx942:sramecc+:xnack-"
    assert lines["transfer"].startswith("pinned-only")
    assert lines["nvme_tier"] == "nvme (POSIX)"
    assert lines["hipfile"] == "not installed"
    assert "never on AMD" in lines["gds"]
    assert lines["attention"] == ATTENTION_SDPA


def test_describe_with_staging_and_hipfile(fake_hip: FakeGPU, fake_hipfile: ModuleType) -> None:
    lines = ROCmPolicy(stage_pageable=True, nvme_tier="hipfile").describe()
    assert lines["transfer"] == "stage: pageable sources copied through a 64.00 MiB pinned slab"
    assert lines["nvme_tier"] == "hipfile (experimental)"
    assert lines["hipfile"] == "available via hipfile (experimental)"


def test_describe_on_a_cpu_build(no_hipfile: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    assert hip_version() is None and gcn_arch_name() is None
    lines = ROCmPolicy().describe()
    assert lines["hip_version"] == "none (this torch is not a ROCm build)"
    assert lines["gfx_arch"] == "unknown (no visible AMD GPU)"
