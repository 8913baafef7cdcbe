"""slide-rocm: SlideFormer on AMD GPUs through a ROCm (HIP) build of torch.

The ``rocm`` device and the experimental ``hipfile`` tier are registered as entry points, so slide-core finds
them by name; importing this package is only needed to use the classes directly.
"""

from slide_rocm.device import ROCmDevice, ROCmFacts
from slide_rocm.hip import gcn_arch_name, hip_version, is_rocm_build
from slide_rocm.hipfile_tier import HipFileTier
from slide_rocm.launch import LaunchParams, launch_params_for
from slide_rocm.policy import ATTENTION_FLASH, ATTENTION_SDPA, ROCmPolicy
from slide_rocm.transfer import PageableSourceError, check_h2d_source

__all__ = [
    "ATTENTION_FLASH",
    "ATTENTION_SDPA",
    "HipFileTier",
    "LaunchParams",
    "PageableSourceError",
    "ROCmDevice",
    "ROCmFacts",
    "ROCmPolicy",
    "check_h2d_source",
    "gcn_arch_name",
    "hip_version",
    "is_rocm_build",
    "launch_params_for",
]
