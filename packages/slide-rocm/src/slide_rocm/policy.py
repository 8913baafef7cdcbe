"""ROCm policies: how bytes reach the GPU, which tier holds NVMe state, which attention runs.

They are policies, not mechanics: the CUDA code paths work on ROCm, but a few CUDA defaults are wrong or
missing on AMD, and each field below records the choice made instead and why.

``ROCmPolicy()`` is the conservative default and imports nothing optional; ``ROCmPolicy.detect()`` probes the
optional modules (hipFile bindings, the ROCm build of flash-attn) once, when asked.
"""

from __future__ import annotations

from dataclasses import dataclass

from slide_rocm.hip import FLASH_ATTN_MODULES, HIPFILE_MODULES, gcn_arch_name, hip_version, probe_module
from slide_rocm.transfer import format_bytes

__all__ = [
    "ATTENTION_FLASH",
    "ATTENTION_SDPA",
    "EXPERIMENTAL_TIERS",
    "HF_ATTENTION",
    "NVME_TIERS",
    "ROCmPolicy",
]

ATTENTION_FLASH = "flash-attn (ROCm build)"
ATTENTION_SDPA = "sdpa (AOTriton)"

HF_ATTENTION: dict[str, str] = {ATTENTION_FLASH: "flash_attention_2", ATTENTION_SDPA: "sdpa"}
"""Each attention choice as Hugging Face's ``attn_implementation`` names it (what a run is given)."""

NVME_TIERS: tuple[str, ...] = ("nvme", "hipfile")
"""Tiers that may hold NVMe-resident state on AMD. ``gds`` is absent on purpose: it is kvikio over cuFile,
and GPUDirect Storage is NVIDIA-only."""

EXPERIMENTAL_TIERS: frozenset[str] = frozenset({"hipfile"})

_NVIDIA_ONLY_TIERS: frozenset[str] = frozenset({"gds", "kvikio", "cufile"})


@dataclass(frozen=True)
class ROCmPolicy:
    """The choices slide-rocm makes where a CUDA default does not carry over to AMD.

    Attributes:
        stage_pageable: False (the default) refuses host-to-device copies from pageable memory; True copies
            them through a pinned staging slab. Refusing is the default because a silent pageable upload
            stalls the GPU queues on ROCm; staging is for callers that cannot pin their sources.
        staging_bytes: size of that staging slab (split in two halves for double buffering).
        pinned_round_up_max_waste: ``alloc_pinned`` uses torch's pinned allocator (hipHostMalloc), which
            rounds a request up to a power of two, only while that wastes at most this fraction of the
            request; larger slabs register exactly the bytes asked for with hipHostRegister instead.
        nvme_tier: the tier for NVMe-resident state. ``"nvme"`` (POSIX reads into pinned slabs, from
            slide-io) everywhere; ``"hipfile"`` (AMD's GPU-direct storage) only when its Python bindings
            import, and it is experimental. Never ``"gds"``: kvikio/cuFile do not run on AMD.
        attention: ``"flash-attn (ROCm build)"`` when the ROCm build of flash-attn imports on a HIP torch,
            else ``"sdpa (AOTriton)"``, the fused attention PyTorch ships for ROCm.
    """

    stage_pageable: bool = False
    staging_bytes: int = 64 << 20
    pinned_round_up_max_waste: float = 0.125
    nvme_tier: str = "nvme"
    attention: str = ATTENTION_SDPA

    def __post_init__(self) -> None:
        if self.staging_bytes < 2:
            raise ValueError(f"staging_bytes must be at least 2, got {self.staging_bytes}")
        if not 0.0 <= self.pinned_round_up_max_waste <= 1.0:
            raise ValueError(f"pinned_round_up_max_waste must be in [0, 1], got {self.pinned_round_up_max_waste}")
        if self.nvme_tier in _NVIDIA_ONLY_TIERS:
            raise ValueError(
                f"nvme_tier {self.nvme_tier!r} is GPUDirect Storage (kvikio/cuFile), which is NVIDIA-only; "
                "on AMD use 'nvme' (POSIX) or the experimental 'hipfile'"
            )
        if self.nvme_tier not in NVME_TIERS:
            raise ValueError(f"nvme_tier must be one of {NVME_TIERS}, got {self.nvme_tier!r}")
        if self.nvme_tier == "hipfile" and probe_module(HIPFILE_MODULES) is None:
            raise ValueError(
                "nvme_tier 'hipfile' needs AMD hipFile Python bindings (tried "
                f"{', '.join(HIPFILE_MODULES)}); none imports here, use nvme_tier='nvme'"
            )
        if self.attention not in (ATTENTION_FLASH, ATTENTION_SDPA):
            raise ValueError(f"attention must be {ATTENTION_FLASH!r} or {ATTENTION_SDPA!r}, got {self.attention!r}")

    @classmethod
    def detect(cls, *, stage_pageable: bool = False, prefer_hipfile: bool = False) -> ROCmPolicy:
        """The policy for this machine: probes flash-attn and, when asked for, hipFile.

        hipFile is opt-in (``prefer_hipfile``) because it is experimental; even then it is chosen only when
        its bindings import, otherwise the POSIX ``nvme`` tier is.
        """
        hipfile = prefer_hipfile and probe_module(HIPFILE_MODULES) is not None
        flash = hip_version() is not None and probe_module(FLASH_ATTN_MODULES) is not None
        return cls(
            stage_pageable=stage_pageable,
            nvme_tier="hipfile" if hipfile else "nvme",
            attention=ATTENTION_FLASH if flash else ATTENTION_SDPA,
        )

    @property
    def transfer_rule(self) -> str:
        """``"pinned-only"`` or ``"stage"``."""
        return "stage" if self.stage_pageable else "pinned-only"

    @property
    def nvme_tier_experimental(self) -> bool:
        return self.nvme_tier in EXPERIMENTAL_TIERS

    def describe(self, index: int = 0) -> dict[str, str]:
        """Lines for ``slide doctor``: the HIP version, the GPU target and every choice with its reason."""
        hipfile_module = probe_module(HIPFILE_MODULES)
        if self.stage_pageable:
            transfer = f"stage: pageable sources copied through a {format_bytes(self.staging_bytes)} pinned slab"
        else:
            transfer = "pinned-only: host-to-device copies from pageable memory are refused"
        tier = self.nvme_tier + (" (experimental)" if self.nvme_tier_experimental else " (POSIX)")
        return {
            "backend": "rocm",
            "hip_version": hip_version() or "none (this torch is not a ROCm build)",
            "gfx_arch": gcn_arch_name(index) or "unknown (no visible AMD GPU)",
            "transfer": transfer,
            "nvme_tier": tier,
            "hipfile": (f"available via {hipfile_module} (experimental)" if hipfile_module else "not installed"),
            "gds": "never on AMD (kvikio/cuFile are NVIDIA-only)",
            "attention": self.attention,
        }
