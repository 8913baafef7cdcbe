"""AdamW on flat host ranges through torch's own kernels.

It uses ``torch._fused_adamw_`` (one pass, all cores) when this torch build has it for the tensor's
device, and otherwise the same single-tensor arithmetic as ``torch.optim.AdamW(foreach=False)``.
Low-precision gradients are cast into a preallocated fp32 scratch first, so nothing is allocated per step;
a ``grad_scale`` other than 1 is applied in that same scratch (an fp32 gradient is copied there first, since
the caller's gradient is never written). It can correct an update it applied (``Optimizer.correct``, what
gradient clipping needs) through :class:`~slide_core.optim.adamw_correction.AdamWCorrection`.

A split master range (:class:`~slide_core.split_master.SplitMaster`) is decoded into an fp32 scratch,
stepped by the same ops and encoded back: the decode is exact, so the result is bit for bit the one the
fp32 master gets, at about 12 more bytes per parameter of memory traffic than ``FusedAdamW``'s in-register
decode.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from slide_core.optim.adamw_correction import AdamWCorrection
from slide_core.optimizer import AdamWConfig, Coefficient, Correction, Optimizer
from slide_core.split_master import SplitMaster

__all__ = ["TorchAdamW"]


def _fused_adamw_available() -> bool:
    return hasattr(torch, "_fused_adamw_")


class TorchAdamW(Optimizer):
    """AdamW with decoupled weight decay, applied only to ranges flagged ``decay``."""

    state_names = ("exp_avg", "exp_avg_sq")
    split_master = True

    def __init__(self, config: AdamWConfig, *, fused: bool | None = None) -> None:
        super().__init__(config)
        self.fused = _fused_adamw_available() if fused is None else fused
        # Per device: the same instance may update host ranges and device-resident units.
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._master_scratch: dict[torch.device, torch.Tensor] = {}
        self._step_tensors: dict[torch.device, torch.Tensor] = {}
        self._correction = AdamWCorrection(config)

    def device_replica(self) -> TorchAdamW:
        return TorchAdamW(self.config)

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

    def _decoded(self, master: SplitMaster) -> torch.Tensor:
        """A split range's fp32 values, in a scratch kept per device (grown to the largest range seen)."""
        held = self._master_scratch.get(master.device)
        if held is None or held.numel() < master.numel():
            held = self._master_scratch[master.device] = torch.empty(
                master.numel(), dtype=torch.float32, device=master.device
            )
        return master.decode(held[: master.numel()])

    def step(
        self,
        master: torch.Tensor | SplitMaster,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
        grad_scale: float = 1.0,
    ) -> None:
        if isinstance(master, SplitMaster):
            values = self._decoded(master)
            self.step(values, grad, state, lr=lr, step=step, decay=decay, grad_scale=grad_scale)
            master.encode_(values)
            return
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
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(cfg.eps)
        master.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)

    def correct(
        self,
        master: torch.Tensor | SplitMaster,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        applied: Coefficient,
        correction: Correction,
        lr: float,
        step: int,
        decay: bool,
    ) -> None:
        self._correction.apply(correction, master, grad, applied, state, lr=lr, step=step, decay=decay)
