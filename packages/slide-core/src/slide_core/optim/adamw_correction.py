"""Taking back, or redoing with another coefficient, an AdamW update applied with a known gradient.

Gradient clipping applies each unit's update before the step's global norm is known and corrects it once
it is (docs/design/engine.md, "Clipping"); this is that correction for every shipped AdamW optimizer
(``AdamWOptimizer.correct``, which ``CompactAdamW`` wraps in its moment codec).

Undo arithmetic (decoupled AdamW, ``s = lr / (1 - beta1^t)``, ``d = sqrt(v) / sqrt(1 - beta2^t) + eps``,
``g`` the gradient exactly as applied): ``p_decayed = p + s * m / d`` (m and v are still the ones the step
divided by), ``m_prev = (m - (1 - beta1) g) / beta1``, ``v_prev = (v - (1 - beta2) g^2) / beta2``, ``p_prev
= p_decayed / (1 - lr * wd)`` on decay ranges. At ``t = 1`` the moments are restored to exactly zero
(Adam's state before its first step). The result matches the never-updated state to rounding (~1 ulp of
p, a few ulp of m and v, amplified by the ratio of the applied to the final contribution), not bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from slide_core.master_store import MasterRange, as_master_range
from slide_core.optim._adamw_kernels import fused_correct, numba_available
from slide_core.optim.adamw_config import AdamWConfig
from slide_core.optimizer import Coefficient, Correction, scale_into

__all__ = ["AdamWCorrection"]

DEFAULT_PIECE_NUMEL = 16 * 1024 * 1024
"""Elements corrected per fused pass: bounds the fp32 scratch (two of these per device)."""


class AdamWCorrection:
    """Takes back, or redoes with another coefficient, an AdamW update applied with a known gradient.

    One fused pass per piece of at most ``max_range_numel`` elements (so the piece stays in cache and the
    fp32 scratch is bounded): take the step back, then (``rescale``) apply it again with ``c * g`` using
    ``torch.optim.AdamW``'s single-tensor arithmetic. Plain torch ops, so it runs on host and device
    tensors alike; a host range with a float coefficient goes through numba's one-pass kernel instead when
    numba is importable and ``use_fused``. One instance per thread (it owns scratch).
    """

    def __init__(
        self, config: AdamWConfig, max_range_numel: int = DEFAULT_PIECE_NUMEL, *, use_fused: bool = True
    ) -> None:
        self.config = config
        self.max_range_numel = max_range_numel
        self.use_fused = use_fused
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._master_scratch: dict[torch.device, torch.Tensor] = {}

    def scratch_bytes(self, max_range_numel: int) -> int:
        """Bytes of the fp32 scratch a torch-ops correction of ranges up to ``max_range_numel`` holds on a
        device (the scaled gradient and ``denom`` of one piece; device masters are fp32, so no decode)."""
        return 2 * 4 * min(max_range_numel, self.max_range_numel)

    def host_scratch_bytes(self, max_range_numel: int, *, split_master: bool = False) -> int:
        """Bytes a correction of host ranges up to ``max_range_numel`` keeps: nothing when numba's one-pass
        kernel runs it (a host range's coefficient is a float), else :meth:`scratch_bytes` and a split
        master piece decoded to fp32."""
        if self.use_fused and numba_available():
            return 0
        piece = min(max_range_numel, self.max_range_numel)
        return self.scratch_bytes(max_range_numel) + (4 * piece if split_master else 0)

    def _buffers(self, device: torch.device, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._scratch.get(device)
        if held is None or held.numel() < 2 * numel:
            held = self._scratch[device] = torch.empty(2 * numel, dtype=torch.float32, device=device)
        return held[:numel], held[numel : 2 * numel]

    def apply(
        self,
        correction: Correction,
        master: torch.Tensor | MasterRange,
        grad: torch.Tensor,
        applied: Coefficient,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
    ) -> None:
        """Correct ``master`` and ``state`` in place for an update that applied ``applied * grad``.
        ``grad`` (any float dtype) is left untouched."""
        if correction.kind == "keep":
            return
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        master = as_master_range(master)
        if isinstance(applied, float) and self._fused(correction, master, grad, applied, state, lr, step, decay):
            return
        numel = master.numel()
        for lo in range(0, numel, self.max_range_numel):
            hi = min(numel, lo + self.max_range_numel)
            with master[lo:hi].updating(self._decode_scratch) as values:
                self._piece(
                    correction, values, grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], applied, lr, step, decay
                )

    def _decode_scratch(self, numel: int, device: torch.device) -> torch.Tensor:
        """Where a master piece stored other than in fp32 is decoded for the correction (a scratch of its own,
        kept per device; the decode is exact and the piece is encoded back after)."""
        held = self._master_scratch.get(device)
        if held is None or held.numel() < numel:
            held = self._master_scratch[device] = torch.empty(numel, dtype=torch.float32, device=device)
        return held[:numel]

    def _fused(
        self,
        correction: Correction,
        master: MasterRange,
        grad: torch.Tensor,
        applied: float,
        state: Mapping[str, torch.Tensor],
        lr: float,
        step: int,
        decay: bool,
    ) -> bool:
        """Host ranges with numba available: undo and redo in one pass over memory (instead of about
        fifteen torch passes); the result agrees with the torch ops to rounding."""
        if master.device.type != "cpu" or not self.use_fused:
            return False
        new = correction.coeff if correction.kind == "rescale" else None
        return fused_correct(
            self.config, master, grad, state, applied=applied, new_coeff=new, lr=lr, step=step, decay=decay
        )

    def _piece(
        self,
        correction: Correction,
        p: torch.Tensor,
        grad: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        applied: Coefficient,
        lr: float,
        step: int,
        decay: bool,
    ) -> None:
        cfg = self.config
        g, denom = self._buffers(p.device, p.numel())
        scale_into(g, grad, applied)  # bit for bit what the update applied
        beta1, beta2 = cfg.beta1, cfg.beta2
        step_size = lr / (1.0 - beta1**step)
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
        weight_decay = cfg.weight_decay if decay else 0.0
        # 1. Take the Adam step back: m and v are still what it divided by. p becomes p_prev * (1 - lr*wd).
        torch.sqrt(v, out=denom)
        denom.div_(bias_correction2_sqrt).add_(cfg.eps)
        p.addcdiv_(m, denom, value=step_size)
        # 2. Take the moments back. Before the first step they are zero by definition: restore that exactly.
        if step == 1:
            m.zero_()
            v.zero_()
        else:
            m.sub_(g, alpha=1.0 - beta1).div_(beta1)
            v.addcmul_(g, g, value=-(1.0 - beta2)).div_(beta2).clamp_(min=0.0)  # rounding must not go < 0
        if correction.kind == "undo":
            if weight_decay:
                p.div_(1.0 - lr * weight_decay)
            return
        # 3. Redo with c * g (one rounding, as clip_grad_norm_'s in-place multiply), as torch.optim.AdamW
        #    would. The decay factor is still in p, so it is neither divided out nor applied again.
        scale_into(g, grad, correction.coeff)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        torch.sqrt(v, out=denom)
        denom.div_(bias_correction2_sqrt).add_(cfg.eps)
        p.addcdiv_(m, denom, value=-step_size)
