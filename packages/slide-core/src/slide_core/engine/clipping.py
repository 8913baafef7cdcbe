"""Exact global gradient-norm clipping and exact skipping of non-finite steps, by speculation and rollback.

``torch.nn.utils.clip_grad_norm_`` scales every gradient of a step by ``c = min(1, max_norm / (norm +
1e-6))``, where ``norm`` is the 2-norm over *all* parameters' final gradients. The engine updates each
unit as soon as its gradient lands on the host, long before the last block's backward has produced the
rest of the norm. Waiting for the norm would serialize the whole host update after backward, the very
overlap the engine exists for. So the engine speculates, then corrects:

1. Each unit's squared gradient norm is computed on the device right after its gradient is written (fp32,
   no host sync) and copied to a pinned scalar ahead of its chunks. An accumulated host unit's final
   (summed) gradient exists only in its host accumulator, so its squared norm is summed chunk by chunk in
   the pass that accumulates it.
2. Every unit is updated speculatively, with the largest coefficient its own gradient allows,
   ``c_u = min(1, max_norm / (|g_u| + 1e-6))``. Since ``|g| >= |g_u|``, ``c <= c_u``; when the step ends up
   unclipped every ``c_u`` is 1, so nothing is scaled and nothing corrected. A unit with one gradient
   contribution knows ``|g_u|`` before its first chunk is applied; an accumulated unit is applied once its
   last chunk has been summed (same work, a little later). Its gradient is kept: host units' in the pinned
   :class:`~slide_core.engine.grad_ring.GradStore` (the d2h lands there directly: no extra host copy, 2
   bytes/param in bf16) or their fp32 accumulator, resident units' in their device slot or accumulator.
3. At the end of the step the main thread waits for the speculative updates, forms the total norm and
   decides. ``c >= 1``: nothing to do. ``c < 1``: every unit is corrected exactly, one fused pass per chunk
   (:class:`AdamWCorrection`: take the ``c_u * g`` update back, redo it with ``c * g``), on the optimizer
   thread for host units and on the compute stream for resident ones. Non-finite norm: every speculative
   update is taken back and the Adam step counter does not advance.

Why ``c_u`` rather than 1: a correction recovers the moments before the step from their speculative
values, so it amplifies their fp32 rounding by the ratio of speculative to final contribution, ~``a/c``
for m and ``(a/c)^2`` for v when the update applied coefficient ``a``. With ``a = 1`` and ``c = 0.01``
(a loss spike, early training) v would be off by ~1e-4 relative; with ``a = c_u`` the ratio is
``|g| / |g_u|``, modest for every unit that holds a fair share of the norm.

Cost: nothing extra while the norm stays below ``max_norm`` (the overlap is intact; the per-unit device
norms are one reduction each). When clipping triggers: one extra pass over the updated state (master, m, v
and the kept gradient) per step, partly overlapped with the next step's forward. The speculative updates
themselves cost what unclipped ones do on the host: the optimizer applies ``c_u * g`` through
``Optimizer.step``'s ``grad_scale``, which ``FusedAdamW`` multiplies in registers (26 B/param with bf16
grads, not the ~42 of scaling into an fp32 scratch first); resident units still scale into a device scratch
(:class:`ScaledGrads`). A step that clips returns once its speculative host updates are done (it must
report the norm); the next step's first load, the embedding, waited for its update anyway, so only a
device-resident embedding loses a little overlap. The step after it defers instead (Note [Deferred
clipped steps]). Memory: the store replaces the gradient ring, one
compute-dtype element per host-updated param.

Undo arithmetic (decoupled AdamW, ``s = lr / (1 - beta1^t)``, ``d = sqrt(v) / sqrt(1 - beta2^t) + eps``,
``g`` the gradient exactly as applied): ``p_decayed = p + s * m / d`` (m and v are still the ones the step
divided by), ``m_prev = (m - (1 - beta1) g) / beta1``, ``v_prev = (v - (1 - beta2) g^2) / beta2``, ``p_prev
= p_decayed / (1 - lr * wd)`` on decay ranges. At ``t = 1`` the moments are restored to exactly zero
(Adam's state before its first step). The result matches the never-updated state to rounding (~1 ulp of
p, a few ulp of m and v times the amplification above), not bit for bit.

Note [Speculative non-finite guard]: a chunk with NaN or Inf gradients must never be applied, because its
update cannot be taken back (``p + s * m / d`` is NaN). The optimizer thread therefore checks the unit's
device-computed squared norm (it lands, on the d2h stream, before the unit's first chunk) before applying
any chunk of the unit's final contribution, and an accumulated unit's host-summed squared norm before
applying any of it; from the first non-finite value on, nothing more of the step is applied. Resident
units are updated on the compute stream without a host sync, so their gradient is instead zeroed on the
device when its norm is not finite (``masked_fill_``) before the speculative update, which makes that
update undoable too. Tested by ``test_nan_step_is_skipped_exactly``.

Note [Early clipping decision]: when every unit's final gradient norm is on the device (no host unit
sums several contributions on the host: one micro-batch, and a tied embedding that is device-resident or
untied), the main thread reads the per-unit squared norms right after the backward (one sync of the
compute stream, not of the transfers) and, when the step does not clip, returns at once: the speculative
updates are final. Each host unit's 'updated' future is then resolved by whoever comes second, the
optimizer thread at the unit's last chunk (:meth:`ClipStep.finish`) or the main thread's decision
(:meth:`ClipStep.keep`), under the step's lock. So a step that does not clip keeps the overlap of the
host updates with the next forward, exactly as with clipping off. A step that clips, or is not finite,
or has host-summed gradients, takes the path below. Tested by
``test_clipping_that_does_not_trigger_does_not_wait``.

Note [Deferred clipped steps]: when clipping triggers, the speculation above pays for every host update
twice (the speculative pass during backward, the correction after it), and on a machine where the host
update is the slower side that second pass is all exposed: the 3B preset at 12 GiB ran at 53% of its
unclipped speed on the H200. Clipping tends to persist from one step to the next (early training, loss
spikes, a max_norm below the typical norm), so after a step that clipped the engine *defers* instead
of speculating (``ClipStep.deferred``): each host chunk that lands is only held (``ClipStep.held``,
nothing applied), and once the norm is known the main thread queues one update per host unit with the
final coefficient as ``grad_scale``, in forward order, so the next forward's loads wait only for the
units they need and the host update overlaps that forward. One pass per parameter, but none during the
backward: the better bet when the step is going to clip. Device-resident units still speculate (their
correction is a device pass). A deferred step that turns out not to clip applies the held gradients
with coefficient 1, which is exactly the unclipped update; only overlap is lost. Units whose state is
on NVMe read it ahead in forward order then (state_offload.py). The held
ranges obey the same ordering as corrections (Note [Clip rollback ordering]): the deferred update job
resolves the unit's 'updated' future. Tested by ``test_clipped_steps_defer_the_next_steps_updates`` and
by every ``clips`` and ``mixed`` case of ``test_clipping_matches_clip_grad_norm``.

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
import threading
from collections.abc import Container, Mapping, Sequence
from concurrent.futures import Future
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
    "Coefficient",
    "Correction",
    "ScaledGrads",
    "UnitNorms",
    "clip_coefficient",
    "correct_resident",
    "resident_step",
    "scale_into",
    "unit_coefficient",
]

ADAMW_STATE = ("exp_avg", "exp_avg_sq")
"""The state names the correction understands (TorchAdamW's and FusedAdamW's)."""

CLIP_EPS = 1e-6
"""``clip_grad_norm_``'s epsilon in ``max_norm / (total_norm + eps)``."""

Coefficient = float | torch.Tensor
"""A gradient scale: a host float, or a 0-dim fp32 device tensor (resident units, no host sync)."""


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``clip_grad_norm_``'s coefficient before clamping to 1 (so ``< 1`` means 'clip')."""
    return max_norm / (total_norm + CLIP_EPS)


def unit_coefficient(squared_norm: float, max_norm: float) -> float:
    """The speculative coefficient ``c_u`` of a unit with squared gradient norm ``squared_norm``."""
    return min(1.0, clip_coefficient(math.sqrt(squared_norm), max_norm))


def scale_into(out: torch.Tensor, grad: torch.Tensor, coeff: Coefficient) -> torch.Tensor:
    """``out = coeff * grad`` in fp32. The one way the engine scales a gradient, so that a correction
    recomputes bit for bit the gradient a speculative update applied."""
    out.copy_(grad)
    out.mul_(coeff)
    return out


class ScaledGrads:
    """fp32 scratch, per device, for ``coeff * grad`` ranges. One instance per thread."""

    def __init__(self) -> None:
        self._held: dict[torch.device, torch.Tensor] = {}

    def __call__(self, grad: torch.Tensor, coeff: Coefficient) -> torch.Tensor:
        if isinstance(coeff, float) and coeff == 1.0:
            return grad
        held = self._held.get(grad.device)
        if held is None or held.numel() < grad.numel():
            held = self._held[grad.device] = torch.empty(grad.numel(), dtype=torch.float32, device=grad.device)
        return scale_into(held[: grad.numel()], grad, coeff)


@dataclass(frozen=True)
class Correction:
    """What to do to the step's speculative updates: take them back, rescale them to ``coeff``, or keep
    them; held (deferred) updates are then dropped, applied with ``coeff``, or applied unscaled."""

    kind: Literal["undo", "rescale", "keep"]
    coeff: float = 1.0


@dataclass(frozen=True)
class AppliedRange:
    """One speculatively applied range ``[start, end)`` of a host unit: it applied ``coeff * grad``."""

    start: int
    end: int
    grad: torch.Tensor  # a view of the grad store or of the unit's fp32 accumulator
    decay: bool
    coeff: float


@dataclass
class ClipStep:
    """What the optimizer thread learns during one step's speculative updates.

    Written only by the optimizer thread and read by the main thread after the step's barrier job (Note
    [Clip rollback ordering]), so it needs no lock.
    """

    max_norm: float
    skip_nonfinite: bool
    coeffs: dict[str, float] = field(default_factory=dict)
    """Units with one contribution: ``c_u``, from the device norm that landed before the first chunk."""
    host_sq: dict[str, float] = field(default_factory=dict)
    """Accumulated host units: the squared norm of the final (summed) gradient, summed over chunks."""
    pending: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Accumulated host units: the summed ranges waiting for the unit's last chunk."""
    applied: dict[str, list[AppliedRange]] = field(default_factory=dict)
    deferred: bool = False
    """Host updates wait for the step's norm instead of speculating (Note [Deferred clipped steps])."""
    held: dict[str, list[AppliedRange]] = field(default_factory=dict)
    """Deferred steps: each host unit's landed ranges, not applied yet (``coeff`` is unused)."""
    nonfinite_unit: str | None = None
    """The first unit found with a non-finite gradient (see Note [Speculative non-finite guard])."""
    kept: bool = False
    """Set (under ``lock``) when the main thread decided before the updates ended that they stand."""
    finished: dict[str, Future[None]] = field(default_factory=dict)
    """Host units whose last chunk was applied before that decision, with their 'updated' futures."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def mark_nonfinite(self, name: str) -> None:
        if self.nonfinite_unit is None:
            self.nonfinite_unit = name

    @property
    def halted(self) -> bool:
        """True once nothing more of the step may be applied."""
        return self.skip_nonfinite and self.nonfinite_unit is not None

    def finish(self, name: str, updated: Future[None]) -> None:
        """Optimizer thread, after a host unit's last chunk: release the unit now if the step was already
        kept, else leave that to the main thread's decision (Note [Early clipping decision])."""
        with self.lock:
            if not self.kept:
                self.finished[name] = updated
                return
        updated.set_result(None)

    def keep(self, updated: Mapping[str, Future[None]], residents: Container[str]) -> None:
        """Main thread: every speculative update of the step stands. Release the resident units (their
        updates are in the compute stream already) and the host units that are done; the optimizer thread
        releases the others as their last chunk lands."""
        with self.lock:
            self.kept = True
            done = dict(self.finished)
        for name, future in updated.items():
            if name in residents:
                future.set_result(None)
        for future in done.values():
            future.set_result(None)

    def add_sq(self, name: str, value: float) -> None:
        self.host_sq[name] = self.host_sq.get(name, 0.0) + value

    def record(self, name: str, applied: AppliedRange) -> None:
        self.applied.setdefault(name, []).append(applied)

    def hold(self, name: str, held: AppliedRange) -> None:
        self.held.setdefault(name, []).append(held)


class UnitNorms:
    """Per-unit squared gradient norms: fp32 on the device, and a pinned host copy of each.

    The device slot of a unit sums the squared norms of the unit's gradient contributions of the step (for
    a unit with one contribution, and for a resident unit's final gradient, that is the squared norm of
    the gradient; a host unit with several holds only a finiteness check, its final gradient's norm is
    summed on the host). The main thread reads every slot with the step's loss (Note [Gradient norm of
    every step] in engine.py). The host copy is sent once per step, with the unit's final contribution,
    on the d2h stream ahead of its chunks. ``coeffs`` holds resident units' device-side ``c_u``.
    """

    def __init__(self, device: Device, units: Sequence[Unit]) -> None:
        self._index = {unit.name: index for index, unit in enumerate(units)}
        self.on_device = device.empty(len(units), torch.float32)
        self.on_device.zero_()
        self.on_host = device.alloc_pinned(len(units), torch.float32)
        self.on_host.zero_()
        self.coeffs = device.empty(len(units), torch.float32)
        self.coeffs.fill_(1.0)

    def add(self, unit: Unit, grad: torch.Tensor, *, first: bool) -> torch.Tensor:
        """Compute stream: fold ``|grad|^2`` into the unit's device slot; return that 0-dim slot."""
        squared = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        slot = self.on_device[self._index[unit.name]]
        if first:
            slot.copy_(squared)
        else:
            slot.add_(squared)
        return slot

    def device_coefficient(self, unit: Unit, squared: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Compute stream: ``c_u`` as a 0-dim device tensor (1 where the norm is not finite: the
        gradient was zeroed, see Note [Speculative non-finite guard])."""
        coeff = (max_norm / (squared.sqrt() + CLIP_EPS)).clamp_(max=1.0)
        slot = self.coeffs[self._index[unit.name]]
        slot.copy_(torch.where(torch.isfinite(squared), coeff, torch.ones_like(coeff)))
        return slot

    def coefficient(self, unit: Unit) -> torch.Tensor:
        """The resident unit's device-side ``c_u`` of this step (as its speculative update applied it)."""
        return self.coeffs[self._index[unit.name]]

    def send(self, unit: Unit) -> torch.Tensor:
        """d2h stream: start copying the unit's squared norm to the host; return the pinned 0-dim view."""
        index = self._index[unit.name]
        host = self.on_host[index]
        host.copy_(self.on_device[index], non_blocking=True)
        return host


class AdamWCorrection:
    """Takes back, or redoes with another coefficient, an AdamW update applied with a known gradient.

    One fused pass per piece of at most ``max_range_numel`` elements (so the piece stays in cache and the
    fp32 scratch is bounded): take the step back, then (``rescale``) apply it again with ``c * g`` using
    ``torch.optim.AdamW``'s single-tensor arithmetic. Plain torch ops, so it runs on host and device
    tensors alike. One instance per thread (it owns scratch).
    """

    def __init__(self, config: AdamWConfig, max_range_numel: int, *, use_fused: bool = True) -> None:
        self.config = config
        self.max_range_numel = max_range_numel
        self.use_fused = use_fused
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
        applied: Coefficient,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        step: int,
        decay: bool,
    ) -> None:
        """Correct ``master`` and ``state`` in place for an update that applied ``applied * grad``.
        ``grad`` (any float dtype) is left untouched."""
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if isinstance(applied, float) and self._fused(correction, master, grad, applied, state, lr, step, decay):
            return
        numel = master.numel()
        for lo in range(0, numel, self.max_range_numel):
            hi = min(numel, lo + self.max_range_numel)
            pieces = (master[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi])
            self._piece(correction, *pieces, applied, lr, step, decay)

    def _fused(
        self,
        correction: Correction,
        master: torch.Tensor,
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
        from slide_core.optim.fused_adamw import fused_correct

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
        scale_into(g, grad, applied)  # bit for bit what the speculative update applied
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


def _pieces(unit: Unit, piece_numel: int) -> list[tuple[int, int, bool]]:
    """``[lo, hi)`` pieces of at most ``piece_numel`` that never straddle the unit's decay boundary."""
    decay_numel, numel = unit.layout.decay_numel, unit.layout.numel
    out = []
    for start, end, decay in ((0, decay_numel, True), (decay_numel, numel, False)):
        out.extend((lo, min(end, lo + piece_numel), decay) for lo in range(start, end, piece_numel))
    return out


def resident_step(
    resident: ResidentUnit,
    grad: torch.Tensor,
    coeff: torch.Tensor,
    optimizer: Optimizer,
    scaled: ScaledGrads,
    piece_numel: int,
    *,
    lr: float,
    step: int,
) -> None:
    """Compute stream: a resident unit's speculative step with ``coeff * grad`` (``coeff`` on the device),
    in pieces so the fp32 scratch stays small; as :meth:`ResidentUnits.apply` does for ``step`` mode."""
    for lo, hi, decay in _pieces(resident.unit, piece_numel):
        state = {key: view[lo:hi] for key, view in resident.state.items()}
        optimizer.step(resident.master[lo:hi], scaled(grad[lo:hi], coeff), state, lr=lr, step=step, decay=decay)
    resident.slot.params.copy_(resident.master)


def correct_resident(
    resident: ResidentUnit,
    grad: torch.Tensor,
    applied: torch.Tensor,
    corrector: AdamWCorrection,
    correction: Correction,
    *,
    lr: float,
    step: int,
) -> None:
    """Compute stream: correct a resident unit's speculative update (see Note [Clip rollback ordering])."""
    for lo, hi, decay in _pieces(resident.unit, corrector.max_range_numel):
        state = {key: view[lo:hi] for key, view in resident.state.items()}
        corrector.apply(correction, resident.master[lo:hi], grad[lo:hi], applied, state, lr=lr, step=step, decay=decay)
    resident.slot.params.copy_(resident.master)
