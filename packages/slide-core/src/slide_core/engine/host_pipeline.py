"""Host-updated units: the fp32 master and optimizer state live in host RAM, and each gradient crosses
PCIe to the optimizer thread, which updates the master while the device computes earlier units.

- main thread (``contribute``): write the gradient into the slot's buffer, fold its squared norm on the
  device, hand the buffer to the d2h stage (grad_transfer.py);
- optimizer thread (``apply``): sum several contributions in an fp32 accumulator; each range of the final
  gradient goes to the step's clip strategy, which says with what coefficient to apply it now (or holds
  it); a clipped step's decision comes back through ``finish`` as one correction or held-update job per
  unit (Note [Clip rollback ordering] in docs/design/engine.md);
- h2d thread (``load``): wait for the unit's last update (Note [Update futures]), copy the master in.

The master is stored as ``HostParameters.master_format`` says: the optimizer steps
``HostParameters.master`` (an fp32 range or a split one) and the h2d copies ``h2d_source`` (the fp32 range,
cast on the device, or the split master's bf16 plane as it is: half the bytes over PCIe).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Literal

import torch

from slide_core.device import Device, Event
from slide_core.host_params import HostParameters
from slide_core.optimizer import Correction, Optimizer
from slide_core.unit import Unit

from .clipping import AppliedRange
from .context import Contribution, ContributionKind, StepContext
from .grad_transfer import GradChunk, GradTransfer
from .host_state import HostState
from .master_upload import MasterUpload
from .norms import UnitNorms
from .pipeline import write_gradients
from .slots import ParamSlot
from .timeline import Timeline
from .workers import Workers

__all__ = ["HostPipeline", "ReadAhead"]

ReadAhead = Literal["backward", "forward"] | None
"""After a unit's update, which unit's state to read ahead: the next in backward order (gradients landing),
in forward order (a deferred step's updates), or none."""


class HostPipeline:
    """The units whose update runs on the host optimizer thread, with their state in the host slabs."""

    def __init__(
        self,
        device: Device,
        host_params: HostParameters,
        host_state: HostState,
        optimizer: Optimizer,
        transfer: GradTransfer,
        workers: Workers,
        norms: UnitNorms | None,
        timeline: Timeline,
        forward_position: Mapping[str, int],
        chunk_numel: int,
    ) -> None:
        self.device = device
        self.host_params = host_params
        self.host_state = host_state
        self.optimizer = optimizer
        self.transfer = transfer
        self.workers = workers
        self.norms = norms
        self.timeline = timeline
        self.forward_position = forward_position
        self.chunk_numel = chunk_numel
        self.upload = MasterUpload(device, chunk_numel)
        """The h2d thread's chunked copies into slots (Note [Casting uploads])."""

    # -- compute needs the unit --------------------------------------------------------------------------
    def slot(self, unit: Unit) -> ParamSlot | None:
        return None

    def load(self, unit: Unit, slot: ParamSlot, ready: Future[None], reuse_after: Event | None) -> Event:
        """h2d thread: wait for the unit's last update, then copy its master (or its bf16 plane) into the
        slot."""
        began = time.perf_counter()
        self.workers.wait(ready, f"the update of {unit.name} before loading it")
        self.timeline.host_span(unit.name, "wait", (time.perf_counter() - began) * 1e3)
        device = self.device
        source = self.host_params.h2d_source(unit)
        target = slot.params[: source.numel()]
        with device.stream("h2d"):
            if reuse_after is not None:
                device.wait_event("h2d", reuse_after)
            start = device.record_event("h2d", timing=self.timeline.enabled)
            self.upload.copy(target, source)
            end = device.record_event("h2d", timing=self.timeline.enabled)
        self.timeline.device_span(unit.name, "h2d", start, end)
        return end

    def begin_step(self, ctx: StepContext) -> None:
        pass

    # -- gradients, main thread --------------------------------------------------------------------------
    def writable_grads(
        self, unit: Unit, slot: ParamSlot, contribution: Contribution, ctx: StepContext
    ) -> torch.Tensor | None:
        self._wait_grads_free(unit, slot)
        return slot.grads

    def contribute(
        self,
        unit: Unit,
        slot: ParamSlot,
        grads: Mapping[str, torch.Tensor | None],
        contribution: Contribution,
        ctx: StepContext,
    ) -> None:
        self._wait_grads_free(unit, slot)
        write_gradients(unit, slot.grads, grads, add=False)
        if self.norms is not None:
            self.norms.add(unit, slot.grads[: unit.layout.numel], first=contribution.starts)
        computed = self.device.record_event("compute")
        order = (ctx.step, 0, self.forward_position[unit.name], contribution.index)
        slot.grads_free = self.transfer.send(self, unit, slot.grads, computed, contribution, ctx, order)

    def _wait_grads_free(self, unit: Unit, slot: ParamSlot) -> None:
        """Compute stream: wait until the slot's gradient buffer has been streamed out (its last d2h)."""
        if slot.grads_free is not None:
            event = self.workers.wait(slot.grads_free, f"the gradient buffer of {unit.name}")
            self.device.wait_event("compute", event)

    # -- updates, optimizer thread -----------------------------------------------------------------------
    def apply(self, chunk: GradChunk, grad: torch.Tensor) -> None:
        """Take one landed gradient chunk: sum it, or apply the final gradient's ranges the step's clip
        strategy hands back."""
        began = time.perf_counter()
        unit, lo, hi, contribution, ctx = chunk.unit, chunk.start, chunk.end, chunk.contribution, chunk.ctx
        clip = ctx.clip
        if chunk.norm_sq is not None:
            clip.unit_norm(unit, float(chunk.norm_sq), contribution, ctx.step)
        final: Sequence[AppliedRange] = ()
        if contribution.kind is ContributionKind.ONLY:
            final = clip.ranges(unit, lo, hi, grad, summed=False, last_chunk=chunk.last_chunk)
        else:
            accum = self.host_state.accumulator(unit)[lo:hi]
            if contribution.starts:
                accum.copy_(grad)
            else:
                accum.add_(grad)
                if contribution.final:
                    final = clip.ranges(unit, lo, hi, accum, summed=True, last_chunk=chunk.last_chunk)
        for applied in final:
            self._step(unit, applied, ctx, grad_scale=applied.coeff)
        self.timeline.host_span(unit.name, "update", (time.perf_counter() - began) * 1e3)
        if chunk.last_chunk and contribution.final:
            if clip.releases_at_last_chunk:
                self._release_state(unit, "backward")
            clip.unit_updated(unit.name, ctx.updated[unit.name])

    def _step(self, unit: Unit, applied: AppliedRange, ctx: StepContext, *, grad_scale: float) -> None:
        lo, hi = applied.start, applied.end
        master = self.host_params.master(unit)[lo:hi]
        state = self.host_state.range(self._state(unit), lo, hi)
        if grad_scale == 1.0:  # the keyword only where it matters: optimizer plugins written before it still work
            self.optimizer.step(master, applied.grad, state, lr=ctx.lr, step=ctx.step, decay=applied.decay)
        else:
            self.optimizer.step(
                master, applied.grad, state, lr=ctx.lr, step=ctx.step, decay=applied.decay, grad_scale=grad_scale
            )

    def _state(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The unit's optimizer state to update in place."""
        return self.host_state.views(unit)

    def _release_state(self, unit: Unit, read_ahead: ReadAhead) -> None:
        """After the unit's update of the step: nothing to do for state that stays in the host slabs."""

    # -- the end of a clipped step -----------------------------------------------------------------------
    def finish(self, unit: Unit, ctx: StepContext, correction: Correction) -> None:
        """Held ranges are applied with the final coefficient unless the step is taken back; applied ones
        are corrected unless they stand. Either job resolves the unit's future (Note [Clip rollback
        ordering]); updates that stand were released by the clip strategy (Note [Early clipping decision])."""
        clip, name = ctx.clip, unit.name
        held, applied = clip.held.get(name), clip.applied.get(name)
        submit = self.workers["optimizer"].submit
        if held and correction.kind != "undo":
            coeff = correction.coeff if correction.kind == "rescale" else 1.0
            submit(self.apply_held, unit, held, coeff, ctx, priority=(ctx.step, 1))
        elif correction.kind == "keep":
            if clip.deferred:  # nothing was held (the step halted): nothing to apply
                ctx.updated[name].set_result(None)
        elif applied:
            submit(self.correct, unit, applied, correction, ctx, priority=(ctx.step, 1))
        else:
            ctx.updated[name].set_result(None)

    def apply_held(self, unit: Unit, held: list[AppliedRange], coeff: float, ctx: StepContext) -> None:
        """Optimizer thread: a deferred step's update of ``unit``, every held range scaled by the step's
        final clipping coefficient; then release the unit's next load (Note [Deferred clipped steps])."""
        began = time.perf_counter()
        for applied in held:
            self._step(unit, applied, ctx, grad_scale=coeff)
        self._release_state(unit, "forward")
        self.timeline.host_span(unit.name, "update", (time.perf_counter() - began) * 1e3)
        ctx.updated[unit.name].set_result(None)

    def correct(self, unit: Unit, ranges: list[AppliedRange], correction: Correction, ctx: StepContext) -> None:
        """Optimizer thread: correct the unit's speculative update, then release its next load."""
        began = time.perf_counter()
        master = self.host_params.master(unit)
        states = self._state(unit)
        for applied in ranges:
            lo, hi = applied.start, applied.end
            state = self.host_state.range(states, lo, hi)
            self.optimizer.correct(
                master[lo:hi],
                applied.grad,
                state,
                applied=applied.coeff,
                correction=correction,
                lr=ctx.lr,
                step=ctx.step,
                decay=applied.decay,
            )
        self._release_state(unit, None)
        self.timeline.host_span(unit.name, "update", (time.perf_counter() - began) * 1e3)
        ctx.updated[unit.name].set_result(None)

    # -- checkpoints and drains --------------------------------------------------------------------------
    def state_array(self, unit: Unit, name: str) -> torch.Tensor:
        """The unit's array as a checkpoint stores it: the master in fp32 (a split one decoded)."""
        return self.host_params.read(unit) if name == "master" else self.host_state.views(unit)[name]

    def restore_target(self, unit: Unit, name: str) -> torch.Tensor:
        if name == "master" and self.host_params.split:
            return torch.empty(unit.layout.numel, dtype=torch.float32)  # encoded by ``restored``
        return self.state_array(unit, name)

    def restored(self, unit: Unit, name: str, values: torch.Tensor) -> None:
        if name == "master" and self.host_params.split:
            self.host_params.write(unit, values)
        # every other array was written in place

    def sync_to_host(self, host_state: HostState | None) -> None:
        pass  # the host copies are the ones updated

    def flush(self) -> None:
        pass
