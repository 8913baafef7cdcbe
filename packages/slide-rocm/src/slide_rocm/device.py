"""The ROCm device: the CUDA device's mechanics under ROCm's facts and transfer rule.

A ROCm build of torch drives HIP through the ``torch.cuda`` API, so streams, events and the memory cap are
inherited unchanged from :class:`~slide_core.devices.cuda.CUDADevice`. What changes is policy:

- facts: wavefront 64, at most 16 warps per Triton program, and the gfx target kernels may specialise on;
- pinned memory: every slab must really be page-locked, because host-to-device copies are accepted only
  from pinned memory (see :mod:`slide_rocm.transfer` for why that is a rule on ROCm);
- ``copy_to_device`` enforces that rule, or stages pageable sources when the policy asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slide_core.device import DeviceFacts, Event, StreamRole
from slide_core.devices.cuda import CUDADevice
from slide_rocm.hip import is_rocm_build
from slide_rocm.launch import LaunchParams, launch_params_for, next_power_of_two
from slide_rocm.policy import HF_ATTENTION, ROCmPolicy
from slide_rocm.transfer import PageableSourceError, StagingBuffer, check_h2d_source, format_bytes

__all__ = ["ROCM_MAX_NUM_WARPS", "ROCmDevice", "ROCmFacts", "is_rocm_build"]

ROCM_MAX_NUM_WARPS = 16
"""A HIP workgroup holds at most 1024 lanes: 16 wavefronts of 64 (CUDA fits 32 warps of 32)."""

ROCM_DEFAULT_WARP_SIZE = 64
"""CDNA wavefronts are 64 lanes; used when the device properties do not report ``warp_size``."""


@dataclass(frozen=True)
class ROCmFacts(DeviceFacts):
    """DeviceFacts plus the GPU target: ``gfx_arch`` (``"gfx942"``) and the full ``gcn_arch_name``
    (``"gfx942:sramecc+:xnack-"``), so kernels and the planner can specialise per generation."""

    gfx_arch: str = ""
    gcn_arch_name: str = ""


class ROCmDevice(CUDADevice):
    """One AMD GPU seen through a ROCm build of torch. Streams are created in ``open``, as for CUDA."""

    backend = "rocm"

    def __init__(
        self, index: int = 0, memory_limit_bytes: int | None = None, *, policy: ROCmPolicy | None = None
    ) -> None:
        if not is_rocm_build():
            built_for = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
            raise RuntimeError(
                f"the rocm device needs a ROCm (HIP) build of torch, but torch {torch.__version__} is "
                f"built for {built_for} (torch.version.hip is not set). Install a ROCm wheel, e.g. "
                "`pip install torch --index-url https://download.pytorch.org/whl/rocm6.2`, "
                "or use --device cuda/cpu"
            )
        super().__init__(index, memory_limit_bytes)
        self.policy = policy if policy is not None else ROCmPolicy()
        self._facts: ROCmFacts | None = None
        self._staging: StagingBuffer | None = None

    # -- facts -----------------------------------------------------------------------------------------
    def facts(self) -> ROCmFacts:
        if self._facts is None:
            props = torch.cuda.get_device_properties(self.index)
            gcn_arch_name = str(getattr(props, "gcnArchName", "") or "")
            self._facts = ROCmFacts(
                name=str(props.name),
                backend=self.backend,
                total_memory_bytes=int(props.total_memory),
                multiprocessor_count=int(props.multi_processor_count),
                warp_size=int(getattr(props, "warp_size", None) or ROCM_DEFAULT_WARP_SIZE),
                max_num_warps=ROCM_MAX_NUM_WARPS,
                gfx_arch=gcn_arch_name.split(":", 1)[0],
                gcn_arch_name=gcn_arch_name,
            )
        return self._facts

    # -- what a run defaults to here (the policy reaching the run) -------------------------------------
    def preferred_activation_tier(self) -> str:
        """The policy's NVMe tier (``nvme``, or the experimental ``hipfile`` when chosen): never ``gds``,
        which is NVIDIA-only."""
        return self.policy.nvme_tier

    def preferred_attention(self) -> str:
        """The policy's attention as Hugging Face names it: ``flash_attention_2`` for the ROCm build of
        flash-attn, else ``sdpa`` (AOTriton)."""
        return HF_ATTENTION[self.policy.attention]

    @classmethod
    def doctor_facts(cls) -> dict[str, str]:
        """The policy this machine would get (``ROCmPolicy.detect``), every choice with its reason."""
        return dict(ROCmPolicy.detect().describe())

    def launch_params(self, row_numel: int) -> LaunchParams:
        """Triton ``num_warps``/``BLOCK_SIZE`` for a row of ``row_numel`` elements on this GPU."""
        return launch_params_for(self.facts(), row_numel)

    # -- lifecycle -------------------------------------------------------------------------------------
    def _open_resources(self) -> None:
        super()._open_resources()
        if self.policy.stage_pageable:
            slab = self.alloc_pinned(self.policy.staging_bytes, torch.uint8)
            self._staging = StagingBuffer(slab, self.stream, self.record_event)

    def _close_resources(self) -> None:
        if self._staging is not None:
            self._staging.drain()
        # The parent synchronizes, then unregisters every slab it registered, the staging slab included.
        super()._close_resources()
        self._staging = None

    # -- memory ----------------------------------------------------------------------------------------
    def alloc_pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """One page-locked host slab per call; it is the only kind of memory ``copy_to_device`` accepts.

        Requests that torch's pinned allocator (hipHostMalloc, the memory ROCm's DMA engines are tuned for)
        can serve without much waste go there. That allocator rounds every request up to a power of two, so
        when the rounding would waste more than ``policy.pinned_round_up_max_waste`` of the request (a 12 GiB
        master slab would take 16 GiB), the exact bytes are registered once, here, with hipHostRegister
        (``torch.cuda.cudart()`` is the HIP runtime on ROCm builds). Registering once at allocation is the
        opposite of what ROCm does for a pageable copy, which pins in place on every transfer.

        Either way the slab is checked with ``is_pinned()``: a registration the runtime did not honour is
        undone and the slab allocated pinned instead, since an unpinned slab would make every later copy
        from it fail the transfer rule.
        """
        if numel < 0:
            raise ValueError(f"alloc_pinned needs numel >= 0, got {numel}")
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(numel, dtype=dtype)
        waste = (next_power_of_two(nbytes) - nbytes) / nbytes
        if waste <= self.policy.pinned_round_up_max_waste:
            return self._pinned_empty(numel, dtype)
        tensor = super().alloc_pinned(numel, dtype)
        if tensor.is_pinned():
            return tensor
        self._registered = [held for held in self._registered if held is not tensor]
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        return self._pinned_empty(numel, dtype)

    @staticmethod
    def _pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(numel, dtype=dtype, pin_memory=True)
        if not tensor.is_pinned():
            nbytes = tensor.numel() * tensor.element_size()
            raise RuntimeError(f"pinned allocation of {format_bytes(nbytes)} came back pageable")
        return tensor

    # -- transfers -------------------------------------------------------------------------------------
    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, role: StreamRole = "h2d") -> Event:
        """Copy ``src`` into the device tensor ``dst`` on the ``role`` stream and return its end event.

        A pageable host ``src`` is refused with :class:`~slide_rocm.transfer.PageableSourceError`, or staged
        through the pinned slab when ``policy.stage_pageable`` is set. The copy is asynchronous: the caller
        keeps ``src`` alive and unmodified, and waits on the event (``wait_event``) before reading ``dst``
        on another stream; ``keep_alive(dst, role)`` is the caller's, as for any device tensor. A staged
        ``src`` has already been read when this returns (only the staging slab is still in flight).
        """
        if dst.numel() != src.numel() or dst.dtype != src.dtype:
            raise ValueError(
                f"copy_to_device needs matching tensors, got dst {dst.numel()} x {dst.dtype} "
                f"and src {src.numel()} x {src.dtype}"
            )
        if not dst.is_contiguous():
            raise ValueError("copy_to_device needs a contiguous dst")
        self._require(role)  # a known role on an open device, before any bytes move
        try:
            check_h2d_source(src)
        except PageableSourceError:
            if self._staging is None:
                raise
            return self._staging.copy(dst, src, role)
        if src.device.type == "cpu" and not src.is_contiguous():
            # Flattening would gather it into a fresh, pageable host tensor: the very copy the rule forbids.
            raise ValueError(
                "copy_to_device needs a contiguous src; a strided pinned view would be gathered "
                "into pageable memory first"
            )
        with self.stream(role):
            dst.view(-1).copy_(src.reshape(-1), non_blocking=True)
        return self.record_event(role)
