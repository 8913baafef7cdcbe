"""Exact global gradient-norm clipping and exact skipping of non-finite steps, by speculation and rollback.

``torch.nn.utils.clip_grad_norm_`` scales every gradient of a step by ``c = min(1, max_norm / (norm +
1e-6))``, where ``norm`` is the 2-norm over *all* parameters' final gradients. The engine updates each
unit as soon as its gradient chunks land on the host, long before the last block's backward has produced
the rest of the norm. Waiting for the norm would serialize the whole host update after backward, the very
overlap the engine exists for. So the engine speculates:

1. Every unit is updated as its gradients land, assuming ``c = 1``. Its gradients are kept: host units'
   in the pinned :class:`~slide_core.engine.grad_ring.GradStore` (the d2h lands there directly, so no
   extra copy; 2 bytes/param in bf16), accumulated units' in their fp32 accumulators, resident units' in
   their device slot or accumulator.
2. Each unit's squared norm is computed on the device right after its gradient is written (fp32, no host
   sync) and copied to a pinned scalar with its chunks. An accumulated host unit's final gradient exists
   only in its host accumulator, so its squared norm is summed chunk by chunk in the pass that applies it.
3. At the end of the step the main thread waits for the speculative updates, forms the total norm and
   decides. ``c >= 1``: nothing to do. ``c < 1``: every unit is corrected exactly, one fused pass per chunk
   (:class:`AdamWCorrection`: take the update back from the kept gradient, redo it with ``c * g``), on the
   optimizer thread for host units and on the compute stream for resident ones. Non-finite norm: every
   speculative update is taken back and the Adam step counter does not advance.

Cost: nothing extra while the norm stays below ``max_norm`` (the overlap is intact; the per-unit device
norms are a reduction each). When clipping triggers, one extra pass over the updated state (master, m, v
and the kept gradient) per step, partly overlapped with the next step's forward. Either way ``step``
returns only once the step's host updates are done (it must report the norm): the next step's first load,
the embedding, had to wait for its update anyway, so only a device-resident embedding loses a little
overlap. Memory: the store replaces the gradient ring, one compute-dtype element per host-updated param.

Undo arithmetic (decoupled AdamW, ``s = lr / (1 - beta1^t)``, ``d = sqrt(v) / sqrt(1 - beta2^t) + eps``):
``p_decayed = p + s * m / d`` (m and v are still the ones the step divided by), ``m_prev = (m - (1 - beta1)
g) / beta1``, ``v_prev = (v - (1 - beta2) g^2) / beta2``, ``p_prev = p_decayed / (1 - lr * wd)`` on decay
ranges. At ``t = 1`` the moments are restored to exactly zero (Adam's state before its first step). The
result matches the never-updated state to rounding (~1 ulp of p, a few ulp of m and v), not bit for bit.

Note [Speculative non-finite guard]: a chunk with NaN or Inf gradients must never be applied, because its
update cannot be taken back (``p + s * m / d`` is NaN). The optimizer thread therefore checks the unit's
device-computed squared norm (it lands, on the d2h stream, before the unit's first chunk) before applying
any chunk of the unit's final contribution, and an accumulated unit's host squared norm chunk by chunk;
from the first non-finite value on, no further chunk of the step is applied. Resident units are updated on
the compute stream without a host sync, so their gradient is instead zeroed on the device when its norm is
non-finite (``masked_fill_``) before the speculative update, which makes that update undoable too.
Tested by ``test_nan_step_is_skipped_exactly``.

Note [Clip rollback ordering]: a unit's ``updated`` future of the step (Note [Update futures]) is resolved
by the main thread's decision or, when the unit needs a correction, by the correction job; never at the
unit's last chunk. So the next step's load of a unit waits for its correction, and so, transitively, does
everything that could overwrite what the correction reads: the unit's next gradient transfer into the store
follows its next backward, which follows its load. Accumulators are reset by a ``stash`` job of the next
step, queued on the FIFO optimizer thread after the corrections. Resident corrections run on the compute
stream before the next step's compute is issued. The decision itself waits for the step's last d2h job and
then for a barrier job on the optimizer thread, after which every speculative update of the step is done
and :class:`ClipStep` is read without locks. Tested by ``test_clipping_matches_clip_grad_norm``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from slide_core.device import Device
from slide_core.optimizer import AdamWConfig, Optimizer
from slide_core.unit import Unit

from .resident import ResidentUnit

__all__ = [
    "ADAMW_STATE",
    "AdamWCorrection",
    "AppliedRange",
    "ClipStep",
    "Correction",
    "UnitNorms",
    "clip_coefficient",
    "correct_resident",
    "resident_step",
]

ADAMW_STATE = ("exp_avg", "exp_avg_sq")
"""The state names the correction understands (TorchAdamW's and FusedAdamW's)."""

CLIP_EPS = 1e-6
"""``clip_grad_norm_``'s epsilon in ``max_norm / (total_norm + eps)``."""


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``clip_grad_norm_``'s coefficient before clamping to 1 (so ``< 1`` means 'clip')."""
    return max_norm / (total_norm + CLIP_EPS)


@dataclass(frozen=True)
class Correction:
    """What to do to an update applied speculatively with coefficient 1."""

    kind: Literal["undo", "rescale"]
    coeff: float = 1.0


@dataclass(frozen=True)
class AppliedRange:
    """One speculatively applied range ``[start, end)`` of a host unit and the gradient it applied."""

    start: int
    end: int
    grad: torch.Tensor  # a view of the grad store or of the unit's fp32 accumulator
    decay: bool


@dataclass
class ClipStep:
    """What the optimizer thread learns during one step's speculative updates.

    Written only by the optimizer thread and read by the main thread after the step's barrier job (Note
    [Clip rollback ordering]), so it needs no lock.
    """

    skip_nonfinite: bool
    host_sq: dict[str, float] = field(default_factory=dict)
    """Accumulated host units: the squared norm of the final (summed) gradient, summed over chunks."""
    applied: dict[str, list[AppliedRange]] = field(default_factory=dict)
    nonfinite_unit: str | None = None
    """The first unit found with a non-finite gradient (see Note [Speculative non-finite guard])."""

    def mark_nonfinite(self, name: str) -> None:
        if self.nonfinite_unit is None:
            self.nonfinite_unit = name

    @property
    def halted(self) -> bool:
        """True once no further chunk of the step may be applied."""
        return self.skip_nonfinite and self.nonfinite_unit is not None

    def add_sq(self, name: str, value: float) -> None:
        self.host_sq[name] = self.host_sq.get(name, 0.0) + value

    def record(self, name: str, applied: AppliedRange) -> None:
        self.applied.setdefault(name, []).append(applied)


class UnitNorms:
    """Per-unit squared gradient norms: fp32 on the device, and a pinned host copy of each.

    The device slot of a unit sums the squared norms of the unit's gradient contributions of the step (for
    a unit with one contribution, and for a resident unit's final gradient, that is the squared norm of
    the gradient). The host copy is sent once per step, with the unit's final contribution, on the d2h
    stream ahead of its chunks.
    """

    def __init__(self, device: Device, units: Sequence[Unit]) -> None:
        self._index = {unit.name: index for index, unit in enumerate(units)}
        self.on_device = device.empty(len(units), torch.float32)
        self.on_device.zero_()
        self.on_host = device.alloc_pinned(len(units), torch.float32)
        self.on_host.zero_()

    def add(self, unit: Unit, grad: torch.Tensor, *, first: bool) -> torch.Tensor:
        """Compute stream: fold ``||grad||^2`` into the unit's device slot; return that 0-dim slot."""
        squared = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        slot = self.on_device[self._index[unit.name]]
        if first:
            slot.copy_(squared)
        else:
            slot.add_(squared)
        return slot

    def send(self, unit: Unit) -> torch.Tensor:
        """d2h stream: start copying the unit's squared norm to the host; return the pinned 0-dim view."""
        index = self._index[unit.name]
        host = self.on_host[index]
        host.copy_(self.on_device[index], non_blocking=True)
        return host

    def host_value(self, unit: Unit) -> float:
        """The landed host copy (after the unit's first chunk was synchronized)."""
        return float(self.on_host[self._index[unit.name]])

    def device_values(self, units: Sequence[Unit]) -> list[float]:
        """The device slots of ``units``. note: CPU-GPU sync point (once per step, residents only)."""
        if not units:
            return []
        indices = torch.tensor([self._index[unit.name] for unit in units], device=self.on_device.device)
        return self.on_device.index_select(0, indices).tolist()


class AdamWCorrection:
    """Takes back, or redoes with a scaled gradient, an AdamW update applied with a known gradient.

    One fused pass per piece of at most ``max_range_numel`` elements (so the piece stays in cache and the
    fp32 scratch is bounded): take the step back, then (``rescale``) apply it again with ``c * g`` using
    ``torch.optim.AdamW``'s single-tensor arithmetic. Plain torch ops, so it runs on host and device
    tensors alike. One instance per thread (it owns scratch).
    """

    def __init__(self, config: AdamWConfig, max_range_numel: int) -> None:
        self.config = config
        self.max_range_numel = max_range_numel
        self._scratch: dict[torch.device, torch.Tensor] = {}

    def _buffers(self, device: torch.device, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._scratch.get(device)
        if held is None or held.numel() < 2 * numel:
            held = self._scratch[device] = torch.empty(2 * numel, dtype=torch.float32, device=device)
        return held[:numel], held[numel : 2 * numel]

    def apply(
        self,
        correction: Correction,
        master: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
    ) -> None:
        """Correct ``master`` and ``state`` in place; ``grad`` (any float dtype) is left untouched."""
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        numel = master.numel()
        for lo in range(0, numel, self.max_range_numel):
            hi = min(numel, lo + self.max_range_numel)
            self._piece(correction, master[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], lr, step, decay)

    def _piece(
        self,
        correction: Correction,
        p: torch.Tensor,
        grad: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        lr: float,
        step: int,
        decay: bool,
    ) -> None:
        cfg = self.config
        g, denom = self._buffers(p.device, p.numel())
        g.copy_(grad)
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
        # 3. Redo with c * g, as torch.optim.AdamW after clip_grad_norm_ would (the decay factor is still in
        #    p, so it is neither divided out nor applied again).
        g.mul_(correction.coeff)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        torch.sqrt(v, out=denom)
        denom.div_(bias_correction2_sqrt).add_(cfg.eps)
        p.addcdiv_(m, denom, value=-step_size)


def _decay_ranges(unit: Unit) -> list[tuple[int, int, bool]]:
    decay_numel, numel = unit.layout.decay_numel, unit.layout.numel
    return [(lo, hi, decay) for lo, hi, decay in ((0, decay_numel, True), (decay_numel, numel, False)) if hi > lo]


def resident_step(resident: ResidentUnit, grad: torch.Tensor, optimizer: Optimizer, *, lr: float, step: int) -> None:
    """Compute stream: one optimizer step of a resident unit from ``grad`` (its final gradient), as
    :meth:`ResidentUnits.apply` does for ``step`` mode, but from any gradient tensor (e.g. its
    accumulator after its norm was taken)."""
    for lo, hi, decay in _decay_ranges(resident.unit):
        state = {key: view[lo:hi] for key, view in resident.state.items()}
        optimizer.step(resident.master[lo:hi], grad[lo:hi], state, lr=lr, step=step, decay=decay)
    resident.slot.params.copy_(resident.master)


def correct_resident(
    resident: ResidentUnit,
    grad: torch.Tensor,
    corrector: AdamWCorrection,
    correction: Correction,
    *,
    lr: float,
    step: int,
) -> None:
    """Compute stream: correct a resident unit's speculative update (see Note [Clip rollback ordering])."""
    for lo, hi, decay in _decay_ranges(resident.unit):
        state = {key: view[lo:hi] for key, view in resident.state.items()}
        corrector.apply(correction, resident.master[lo:hi], grad[lo:hi], state, lr=lr, step=step, decay=decay)
    resident.slot.params.copy_(resident.master)
