"""The engine's one frozen, typed configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """How the engine slides units through the device.

    - ``block_slots``: device cache slots for block units (params + grads each). Prefetch can run at most
      ``block_slots - 1`` units ahead of compute; 1 means no overlap at all.
    - ``compute_dtype``: the dtype of the device copies of parameters, activations and gradients. The
      master weights and optimizer state are always fp32.
    - ``master_format``: how the host holds the fp32 master (master_format.py): ``fp32``, ``split`` (a
      bf16 plane the device copies as it is, half the host-to-device bytes, plus the low 16 bits and a
      tie bit: exact; bf16 compute only) or ``auto`` (whichever ``HostParameters`` holds; allocate it with
      ``choose_master_format``, which picks split wherever it can run).
    - ``transfer_chunk_numel``: elements per host<->device chunk; gradient chunks feed the optimizer as they
      land, so smaller chunks start updates sooner at a small per-chunk cost.
    - ``grad_ring_slots``: pinned host chunks for gradients in flight between the device and the optimizer
      (at least this many).
    - ``grad_ring_fraction``: ...or enough chunks for this fraction of the host-updated parameters, if
      more. The ring holds the backlog the optimizer carries from one backward into the next forward
      (see Note [Optimizer priority] in workers.py). A ring smaller than that backlog stalls the
      backward on free chunks, and the CPU then idles through the next forward. When the host update
      is the slower side the backlog is about ``1 - T_backward / T_update`` of the model (about half
      for the 3B preset on the H200, see docs/benchmarks.md). It costs one compute-dtype element per
      ring parameter (1 byte/param in bf16 at 0.5). 0 keeps the ring at ``grad_ring_slots``.
    - ``timeout_s``: the longest any single wait may block before the engine gives up with an error.
    - ``resident_units``: names of units whose master and optimizer state live on the device (see
      resident_pipeline.py); they skip PCIe and the host optimizer entirely.
    - ``max_grad_norm``: global gradient-norm clipping, exactly ``torch.nn.utils.clip_grad_norm_`` over
      every parameter's final gradient of the step; 0 turns it off. Updates stay overlapped with
      backward through speculation and rollback; after a step that clipped, host updates wait for the
      norm and overlap the next forward instead (docs/design/engine.md, "Clipping"). With it on, the host gradients of a
      step are kept in a full-model pinned store instead of ``grad_ring_slots`` ring chunks: one
      compute-dtype element per host-updated parameter (2 bytes/param in bf16).
    - ``skip_nonfinite``: with clipping on, a step whose gradient norm is NaN or Inf is skipped exactly
      (every speculative update taken back, the Adam step counter not advanced). With clipping off the
      engine cannot take updates back, so it only detects non-finite per-unit gradients and stops with an
      :class:`EngineError`. False turns both off (non-finite gradients are applied as they are).
    - ``max_consecutive_nonfinite``: this many skipped steps in a row raise an :class:`EngineError`.
    - ``report_grad_norm``: report every step's global gradient norm in ``StepResult.grad_norm`` (with
      clipping on it is always reported). Units with one gradient contribution per step have their
      squared norms formed on the device and read with the loss, at no extra sync. A host-updated unit
      whose gradient is summed on the host (several micro-batches, or a tied embedding's two shares) has
      its norm formed there as it is summed, so such a step returns only once the host has summed (and
      updated) those units: with gradient accumulation that is the whole host update, which otherwise
      overlaps the next step's forward. False keeps steps norm-free (``grad_norm`` None without
      clipping) and that overlap intact. See Note [Gradient norm of every step] in docs/design/engine.md.
    """

    block_slots: int = 2
    compute_dtype: torch.dtype = torch.bfloat16
    master_format: str = "auto"
    transfer_chunk_numel: int = 16 * 1024 * 1024
    grad_ring_slots: int = 4
    grad_ring_fraction: float = 0.5
    timeout_s: float = 600.0
    record_timings: bool = True
    resident_units: tuple[str, ...] = ()
    offloaded_units: tuple[str, ...] = ()
    """Units whose Adam state lives on the engine's ``state_tier`` (NVMe), see state_offload.py."""
    streamed_units: tuple[str, ...] = ()
    """Units updated on the device as they stream through it (streamed_pipeline.py): master and optimizer
    state stay in host RAM, travel to the device for the unit's backward and back after its update; the
    gradient never crosses PCIe and the host optimizer does no work for them."""
    streamable_units: tuple[str, ...] = ()
    """Units besides ``streamed_units`` that the run may move to the GPU-streamed update, and back, between
    two steps (:meth:`Engine.place_streamed`, Note [Re-placement at a step boundary] in replacement.py).
    They start on the host; the streamed path is built for them too (their shards and pinned host ranges,
    its staging sets sized for the largest of them and ``streamed_units``), so a move allocates nothing.
    Each keeps its state in the host slabs (neither resident nor offloaded)."""
    staging_sets: int = 3
    """Device staging sets the streamed units take turns in, each sized for the largest streamed unit:
    three let a unit's upload overlap the write-back before it (Note [Three staging sets] in
    update_staging.py); two save one set's memory where the GPU budget cannot hold three."""
    max_grad_norm: float = 0.0
    skip_nonfinite: bool = True
    max_consecutive_nonfinite: int = 3
    report_grad_norm: bool = True

    def __post_init__(self) -> None:
        if self.block_slots < 1:
            raise ValueError(f"block_slots must be >= 1, got {self.block_slots}")
        if self.transfer_chunk_numel < 1024:
            raise ValueError(f"transfer_chunk_numel must be >= 1024, got {self.transfer_chunk_numel}")
        if not 0.0 <= self.grad_ring_fraction <= 1.0:
            raise ValueError(f"grad_ring_fraction must be in [0, 1], got {self.grad_ring_fraction}")
        if self.grad_ring_slots < 1:
            raise ValueError(f"grad_ring_slots must be >= 1, got {self.grad_ring_slots}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"compute_dtype must be float32, bfloat16 or float16, got {self.compute_dtype}")
        if self.master_format not in ("auto", "fp32", "split"):
            raise ValueError(f"master_format must be auto, fp32 or split, got {self.master_format!r}")
        if self.master_format == "split" and self.compute_dtype != torch.bfloat16:
            raise ValueError(
                f"master_format split stores the bf16 compute copy, so it needs compute_dtype bfloat16, got "
                f"{self.compute_dtype}"
            )
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0.0):
            raise ValueError(f"max_grad_norm must be a finite number >= 0 (0 = off), got {self.max_grad_norm}")
        for other, what in ((self.resident_units, "resident_units"), (self.offloaded_units, "offloaded_units")):
            for units, name in ((self.streamed_units, "streamed_units"), (self.streamable_units, "streamable_units")):
                both = sorted(set(units) & set(other))
                if both:
                    raise ValueError(f"{name} and {what} must not share units, both name {', '.join(both)}")
        if self.staging_sets < 2:
            raise ValueError(
                f"staging_sets must be >= 2 (one unit's upload beside another's update), got {self.staging_sets}"
            )
        if self.max_consecutive_nonfinite < 1:
            raise ValueError(f"max_consecutive_nonfinite must be >= 1, got {self.max_consecutive_nonfinite}")

    @property
    def clipping(self) -> bool:
        """Whether gradient-norm clipping (and with it the exact skip of non-finite steps) is on."""
        return self.max_grad_norm > 0.0

    def ring_slots(self, host_numel: int) -> int:
        """Ring chunks for ``host_numel`` host-updated parameters (see ``grad_ring_fraction``)."""
        wanted = math.ceil(self.grad_ring_fraction * host_numel / self.transfer_chunk_numel)
        return max(self.grad_ring_slots, wanted)
