"""AdamW on flat host ranges through torch's own kernels.

It uses ``torch._fused_adamw_`` (one pass, all cores) when this torch build has it for the tensor's
device, and otherwise the same single-tensor arithmetic as ``torch.optim.AdamW(foreach=False)``.
Low-precision gradients are cast into a preallocated fp32 scratch first, so nothing is allocated per step;
a ``grad_scale`` other than 1 is applied in that same scratch (an fp32 gradient is copied there first, since
the caller's gradient is never written). It can correct an update it applied (``Optimizer.correct``, what
gradient clipping needs) through :class:`~slide_core.optim.adamw_base.AdamWOptimizer`'s.

A master range stored other than in fp32 (a :class:`~slide_core.split_master.SplitMaster`) is decoded
into an fp32 scratch, stepped by the same ops and encoded back (``MasterRange.updating``): the decode is exact, so the result is bit for bit the one the
fp32 master gets, at about 12 more bytes per parameter of memory traffic than ``FusedAdamW``'s in-register
decode.

A range longer than :data:`CHUNK_NUMEL` is updated a chunk at a time, and the single-tensor path divides
into a kept ``denom`` scratch instead of ``sqrt()``'s and ``/``'s temporaries: every op is elementwise, so
the result is bit for bit the unchunked one, and a device-resident unit of hundreds of millions of
parameters (an embedding) needs a few chunks of scratch on the GPU, not fp32 copies of itself
(:meth:`TorchAdamW.device_scratch_bytes` says how many bytes, and the planner prices exactly that).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from slide_core.master_store import MasterRange, as_master_range
from slide_core.optim.adamw_base import AdamWOptimizer
from slide_core.optim.adamw_config import AdamWConfig
from slide_core.optim.adamw_correction import DEFAULT_PIECE_NUMEL

__all__ = ["CHUNK_NUMEL", "TorchAdamW"]

CHUNK_NUMEL = 1 << 22
"""Elements updated per pass of a long range (16 MiB of fp32): bounds the fp32 scratch and the temporaries
of a device range to a few chunks, while a resident embedding still takes only ~100 passes. A multiple of
``state_formats.QUANT_BLOCK`` (64), so a chunk of a block-aligned range keeps its int8 blocks whole."""


def _fused_adamw_available() -> bool:
    return hasattr(torch, "_fused_adamw_")


class TorchAdamW(AdamWOptimizer):
    """AdamW with decoupled weight decay, applied only to ranges flagged ``decay``."""

    def __init__(self, config: AdamWConfig, *, fused: bool | None = None, chunk_numel: int = CHUNK_NUMEL) -> None:
        super().__init__(config, correction_piece_numel=min(chunk_numel, DEFAULT_PIECE_NUMEL))
        self._refuse_compact_state()
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        self.fused = _fused_adamw_available() if fused is None else fused
        self.chunk_numel = chunk_numel
        # Per device: the same instance may update host ranges and device-resident units.
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._denom: dict[torch.device, torch.Tensor] = {}
        self._master_scratch: dict[torch.device, torch.Tensor] = {}
        self._step_tensors: dict[torch.device, torch.Tensor] = {}

    def device_replica(self) -> TorchAdamW:
        return TorchAdamW(self.config, chunk_numel=self.chunk_numel)

    def device_scratch_bytes(self, max_range_numel: int, *, corrects: bool = False) -> int:
        """What a device range's step holds: the fp32 gradient of one chunk (device gradients are in the
        compute dtype), ``torch._fused_adamw_``'s 0-dim step count or the unfused path's ``denom``, and, with
        ``corrects``, the correction's two fp32 pieces (``AdamWCorrection``). No temporaries: every op
        writes in place. The master of a device range is fp32 (``ResidentUnits``), so no decode scratch."""
        chunk = min(max_range_numel, self.chunk_numel)
        held = 4 * chunk + (4 if self.fused else 4 * chunk)
        if corrects:
            held += self._correction.scratch_bytes(chunk)
        return held if max_range_numel > 0 else 0

    def host_scratch_bytes(self, max_range_numel: int, *, corrects: bool = False, split_master: bool = False) -> int:
        """What :meth:`reserve` holds (the fp32 gradient of a whole range), the fused step count or the
        unfused ``denom`` of one chunk, a split range's decoded chunk, and with ``corrects`` the
        correction's pieces (``AdamWCorrection.host_scratch_bytes``)."""
        if max_range_numel <= 0:
            return 0
        chunk = min(max_range_numel, self.chunk_numel)
        held = 4 * max_range_numel + (4 if self.fused else 4 * chunk) + (4 * chunk if split_master else 0)
        if corrects:
            held += self._correction.host_scratch_bytes(chunk, split_master=split_master)
        return held

    def reserve(self, max_range_numel: int, device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        held = self._scratch.get(device)
        if held is None or held.numel() < max_range_numel:
            self._scratch[device] = torch.empty(max_range_numel, dtype=torch.float32, device=device)

    def _fp32(self, grad: torch.Tensor, grad_scale: float) -> torch.Tensor:
        """``grad_scale * grad`` in fp32: ``grad`` itself when that is already it, else the scratch."""
        if grad.dtype == torch.float32 and grad_scale == 1.0:
            return grad
        held = self._scratch.get(grad.device)
        if held is None or held.numel() < grad.numel():
            self.reserve(grad.numel(), grad.device)
        scratch = self._scratch[grad.device][: grad.numel()]
        scratch.copy_(grad)
        if grad_scale != 1.0:
            scratch.mul_(grad_scale)  # as optimizer.scale_into: fp32 * float32(grad_scale), one rounding
        return scratch

    def _held(self, buffers: dict[torch.device, torch.Tensor], numel: int, device: torch.device) -> torch.Tensor:
        """``numel`` fp32 elements of a scratch kept per device (grown to the largest chunk seen)."""
        held = buffers.get(device)
        if held is None or held.numel() < numel:
            held = buffers[device] = torch.empty(numel, dtype=torch.float32, device=device)
        return held[:numel]

    def _decode_scratch(self, numel: int, device: torch.device) -> torch.Tensor:
        """Where a range stored other than in fp32 is decoded for its update (kept per device, grown to the
        largest chunk seen)."""
        return self._held(self._master_scratch, numel, device)

    def step(
        self,
        master: torch.Tensor | MasterRange,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float = 1.0,
    ) -> None:
        master = as_master_range(master)
        numel = master.numel()
        if numel <= self.chunk_numel:
            self._step_chunk(master, grad, state, lr=lr, step=step, decay=decay, grad_scale=grad_scale)
            return
        for lo in range(0, numel, self.chunk_numel):
            hi = min(numel, lo + self.chunk_numel)
            chunk_state = {name: tensor[lo:hi] for name, tensor in state.items()}
            self._step_chunk(
                master[lo:hi], grad[lo:hi], chunk_state, lr=lr, step=step, decay=decay, grad_scale=grad_scale
            )

    def _step_chunk(
        self,
        master: MasterRange,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float,
    ) -> None:
        with master.updating(self._decode_scratch) as values:
            self._step_values(values, grad, state, lr=lr, step=step, decay=decay, grad_scale=grad_scale)

    def _step_values(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float,
    ) -> None:
        """One chunk's update on fp32 values in place (the range itself, or its decoded scratch)."""
        cfg = self.config
        weight_decay = cfg.weight_decay if decay else 0.0
        grad32 = self._fp32(grad, grad_scale)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if self.fused:
            step_tensor = self._step_tensors.get(master.device)
            if step_tensor is None:
                step_tensor = self._step_tensors[master.device] = torch.zeros((), device=master.device)
            step_tensor.fill_(float(step))
            torch._fused_adamw_(
                [master],
                [grad32],
                [exp_avg],
                [exp_avg_sq],
                [],
                [step_tensor],
                lr=lr,
                beta1=cfg.beta1,
                beta2=cfg.beta2,
                weight_decay=weight_decay,
                eps=cfg.eps,
                amsgrad=False,
                maximize=False,
            )
            return
        if weight_decay:
            master.mul_(1.0 - lr * weight_decay)
        exp_avg.lerp_(grad32, 1.0 - cfg.beta1)
        exp_avg_sq.mul_(cfg.beta2).addcmul_(grad32, grad32, value=1.0 - cfg.beta2)
        bias_correction1 = 1.0 - cfg.beta1**step
        bias_correction2_sqrt = math.sqrt(1.0 - cfg.beta2**step)
        # torch.optim.AdamW's (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps), op for op, in place
        denom = torch.sqrt(exp_avg_sq, out=self._held(self._denom, master.numel(), master.device))
        denom.div_(bias_correction2_sqrt).add_(cfg.eps)
        master.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
