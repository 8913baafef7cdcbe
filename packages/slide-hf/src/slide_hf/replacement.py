"""Placement that closes the loop: a run moves units between the host AdamW and the GPU-streamed update from
the rates its own steps measure.

The plan chooses which units to stream before the run, from rates measured alone (`slide doctor`) or in
earlier runs' steps (slide_hf/in_step_rates.py). Inside the run the host AdamW's busy rate and the GPU's
achieved rate can differ from those by tens of percent, and a placement chosen with the wrong ones leaves
the step bound by the host optimizer (too few units streamed) or by PCIe (too many). So with
``--update-placement auto`` the run measures both in its steps after the warm-up, every ``check_every``
steps, and when either has drifted more than ``drift`` from the rates the current placement was chosen
with, asks the planner again: :func:`~slide_hf.planner.plan.replan_streamed`, the placement ``auto``
itself makes (one owner of the decision), fed the measured rates and limited to the units the engine was
built to move (``PlanInputs.streamable_units``, within the staging it holds). It moves units only when the
new placement's planned step is shorter by ``min_gain``; :meth:`Engine.place_streamed` moves them between
two steps, every pending update landed (Note [Re-placement at a step boundary] in
slide_core/engine/replacement.py), and masters and moments stay what the host would have made them.

Hysteresis: a check compares the measured rates with those the last decision used, not with the plan's, so
after a decision (a move or a placement kept) the rates must drift again before the next; the planner's
own gain threshold and ``min_gain`` keep a near tie from moving units; the steps right after a move (its
warm-up) are not measured; and a move back to the placement the previous move left checks half as often
from then on (``BACK_OFF``). PCIe each way is measured too, from the streamed units' uploads and
write-backs (their bytes over their spans, :meth:`InStepMeter.pcie_gbps`), and laid over the plan's rate
where slower (:func:`~slide_hf.in_step_rates.slower_pcie`): a link slower under load than `slide doctor`
measured it alone makes streaming dearer, so the planner streams fewer units (docs/design/engine.md,
"Plans that learn the machine").

Note [Ranks place alike]: with data parallel every rank must update the same units in the same place in the
same step (a unit's collectives do not depend on its placement, but its shard's update must run where the
engine looks for it on every rank). Each rank measures its own steps, but only rank 0 decides: at every
check it decides from its rates and hands its decision (the rates it used and the move, if any) to every
rank (``broadcast_object``, one small collective every ``check_every`` steps, never inside a step), and
every rank applies that same decision to its own engine and its own hysteresis. The ranks count the same
steps, so they reach each check together. Tested with gloo ranks by tests/hf/test_replacement.py, and the
engine's moves by tests/core/test_distributed.py's ``moved`` cases.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from slide_hf.in_step_rates import InStepMeter, slower_pcie

__all__ = ["MeasuredRates", "PlacementChange", "Ranks", "Replacement", "compact_units"]

log = logging.getLogger("slide.replacement")

CHECK_EVERY = 10
"""Steps measured between two checks: enough to average a step's jitter, few enough to act early."""
DRIFT = 0.10
"""A check asks the planner again only when a measured rate differs by more than this fraction from those
the current placement was chosen with (the plan is a planning number, within 10 % of measured steps)."""
MIN_GAIN = 0.03
"""Units move only when the new placement's planned step is shorter by more than this fraction: a move costs
one drain of the pipeline, and a near tie must not flap."""


BACK_OFF = 16
"""A move back to the placement the previous move left doubles the steps between checks, up to this many
times ``check_every``: where the measured rates depend on the placement itself (a host AdamW that runs
faster with fewer units beside the DMA), two placements that each look better from the other settle
instead of alternating."""


@dataclass(frozen=True)
class MeasuredRates:
    """The rates a placement is chosen with: the host AdamW's busy rate (1e9 params/s) in the run's master
    and state format, the GPU's achieved rate (1e12 FLOP/s of the plan's count), and the rate the streamed
    units' uploads (``h2d_gbps``) and write-backs (``d2h_gbps``) reached, GB/s; None where the steps
    measured none of that work (every unit streamed, or none, say)."""

    host_adam_gparams: float | None
    gpu_tflops: float | None
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None

    def drifted(self, chosen_with: MeasuredRates, drift: float) -> bool:
        """Whether a rate measured here differs from ``chosen_with``'s by more than ``drift`` (relative)."""
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(chosen_with), strict=True)
        return any(now is not None and then and abs(now / then - 1) > drift for now, then in pairs)

    def over(self, chosen_with: MeasuredRates) -> MeasuredRates:
        """These rates, with ``chosen_with``'s where these measured none."""
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(chosen_with), strict=True)
        return MeasuredRates(*(now if now is not None else then for now, then in pairs))


@dataclass(frozen=True)
class PlacementChange:
    """One move: after step ``step`` the units ``streamed`` (forward order) are updated on the GPU, every
    other movable unit on the host. ``host_s`` and ``streamed_s``: what the moved units cost per step
    updated on the host (busy AdamW seconds at the measured rate) and GPU-streamed (their busiest resource,
    PCIe or the GPU, at the measured rates); ``planned_s``: the planned step before and after the move at
    the measured rates."""

    step: int
    streamed: tuple[str, ...]
    to_gpu: tuple[str, ...]
    to_host: tuple[str, ...]
    host_s: float
    streamed_s: float
    planned_s: tuple[float, float]
    rates: MeasuredRates
    order: tuple[str, ...] = ()

    def line(self) -> str:
        """What moved and why, in one line."""
        moved = []
        if self.to_gpu:
            moved.append(f"units {compact_units(self.to_gpu, self.order)} now updated on the GPU")
        if self.to_host:
            moved.append(f"units {compact_units(self.to_host, self.order)} now updated on the host")
        host, streamed = f"host AdamW {self.host_s:.3g} s", f"GPU-streamed {self.streamed_s:.3g} s"
        compared = f"{host} > {streamed}" if self.host_s > self.streamed_s else f"{streamed} >= {host}"
        before, after = self.planned_s
        return (
            f"placement after step {self.step}: {'; '.join(moved)} ({compared} a step for them, measured; "
            f"planned step {before:.3g} s -> {after:.3g} s)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "streamed_units": compact_units(self.streamed, self.order),
            "to_gpu": list(self.to_gpu),
            "to_host": list(self.to_host),
            "host_adam_s": self.host_s,
            "gpu_streamed_s": self.streamed_s,
            "planned_step_s": list(self.planned_s),
            "measured": dataclasses.asdict(self.rates),
        }


class PlacesStreamed(Protocol):
    """What a :class:`Replacement` moves units in: the running engine (``Engine.place_streamed``)."""

    def place_streamed(self, names: Sequence[str]) -> tuple[frozenset[str], frozenset[str]]: ...


class Ranks(Protocol):
    """The ranks of a data-parallel run, as the placement loop needs them (slide_core's
    ``ProcessGroupContext`` and ``SingleProcess``): rank 0's decision on every rank."""

    @property
    def rank(self) -> int: ...

    def broadcast_object(self, value: Any, what: str) -> Any: ...


RatesSource = Callable[[InStepMeter], MeasuredRates]
"""Reads the rates of the steps a meter summed (by default :func:`measured_rates`); a test hands one in."""


class Replacement:
    """The in-run placement loop of one run, over its placed plan. Feed it every step's per-unit times
    (:meth:`after_step`); it moves units in the engine when the measured rates say so, and returns the
    move. Holds sums over the steps since the last check, nothing per step."""

    def __init__(
        self,
        plan: Any,
        *,
        warmup_steps: int = 1,
        check_every: int = CHECK_EVERY,
        drift: float = DRIFT,
        min_gain: float = MIN_GAIN,
        rates: RatesSource | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        """``ranks``: a data-parallel run's, whose rank 0 decides for all (Note [Ranks place alike]); None
        for one process."""
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        inputs = plan.inputs
        self.plan = plan
        self.order = tuple(plan.shape.names)
        self.movable = frozenset((*inputs.streamed_units, *inputs.streamable_units))
        """The units the engine was built to move (its streamed path's)."""
        self.streamed = tuple(inputs.streamed_units)
        """The units updated on the GPU now."""
        self.changes: list[PlacementChange] = []
        self.check_every = check_every
        """Steps measured between two checks (doubled by a move back: ``BACK_OFF``)."""
        self._drift, self._min_gain = drift, min_gain
        self._max_check_every = BACK_OFF * check_every
        self._left: tuple[str, ...] | None = None  # the placement the last move left
        self._rates = rates or measured_rates
        self._ranks = ranks
        bandwidths = inputs.bandwidths
        self.chosen_with = MeasuredRates(
            bandwidths.cpu_adam_busy_rate(inputs.optimizer_state, inputs.master_format),
            bandwidths.gpu_tflops,
            bandwidths.h2d_gbps,
            bandwidths.d2h_gbps,
        )
        """The rates the current placement was chosen with: the plan's, then each check's."""
        self._meter = self._new_meter(warmup_steps)

    @staticmethod
    def wanted(plan: Any) -> bool:
        """Whether the run of ``plan`` can move any unit (its plan chose some streamable units)."""
        return bool(plan.inputs.streamable_units)

    def _new_meter(self, warmup_steps: int) -> InStepMeter:
        meter = InStepMeter(self.plan, warmup_steps=warmup_steps)
        meter.placed(self.streamed)
        return meter

    def after_step(self, step: int, times: Mapping[str, Any], engine: PlacesStreamed) -> PlacementChange | None:
        """Step ``step`` is done and ``times`` are its per-unit times: every ``check_every`` measured steps,
        check the rates and move units in ``engine`` if the planner says so. Returns the move, if any
        (already made and logged)."""
        meter = self._meter
        meter.add(times)
        if meter.steps < self.check_every:
            return None
        self._meter = self._new_meter(0)
        decided = self._decision(step, meter)
        if decided is None:
            return None
        measured, change = decided
        self.chosen_with = measured  # hysteresis: the next check needs a new drift from these
        if change is None:
            return None
        engine.place_streamed(change.streamed)  # note: waits for every pending update (a step boundary)
        if self._left is not None and set(change.streamed) == set(self._left):  # back where the last move left
            self.check_every = min(2 * self.check_every, self._max_check_every)  # check half as often
        self._left, self.streamed = self.streamed, change.streamed
        self._meter = self._new_meter(1)  # the first step after a move fills the new pipeline
        self.changes.append(change)
        log.info("%s", change.line())
        return change

    def _decision(self, step: int, meter: InStepMeter) -> tuple[MeasuredRates, PlacementChange | None] | None:
        """A check's outcome: None where the rates have not drifted from those of the last decision, else
        those rates and the move they call for (None: the placement stays). With data parallel, rank 0's,
        on every rank (Note [Ranks place alike])."""
        ranks = self._ranks
        decided: tuple[MeasuredRates, PlacementChange | None] | None = None
        if ranks is None or ranks.rank == 0:
            measured = self._rates(meter).over(self.chosen_with)
            if measured.drifted(self.chosen_with, self._drift):
                decided = (measured, self.decide(step, measured))
        if ranks is not None:
            decided = ranks.broadcast_object(decided, f"rank 0's placement check after step {step}")
        return decided

    def decide(self, step: int, measured: MeasuredRates) -> PlacementChange | None:
        """The planner's placement at ``measured`` rates (:func:`~slide_hf.planner.plan.replan_streamed`),
        as a move from the current one when its planned step is shorter by ``min_gain``; None otherwise."""
        from slide_hf.planner import make_plan
        from slide_hf.planner.plan import replan_streamed
        from slide_hf.planner.unit_costs import RESOURCES, unit_costs

        inputs = self.plan.inputs
        bandwidths = _with_rates(inputs, measured)
        chosen = replan_streamed(self.plan, bandwidths)
        streamed = tuple(name for name in self.order if name in set(chosen.inputs.streamed_units))
        if set(streamed) == set(self.streamed):
            return None
        current = make_plan(
            dataclasses.replace(chosen.inputs, streamed_units=self.streamed, streamable_units=tuple(self.movable))
        )
        if chosen.step_time_s >= current.step_time_s * (1 - self._min_gain):
            return None
        to_gpu = tuple(name for name in streamed if name not in self.streamed)
        to_host = tuple(name for name in self.streamed if name not in streamed)
        moved = set(to_gpu) | set(to_host)
        costs = [c for c in unit_costs(chosen.shape, chosen.inputs) if c.name in moved]
        host_rate = (measured.host_adam_gparams or 0.0) * 1e9
        host_s = sum(c.numel for c in costs) / host_rate if host_rate else 0.0
        streamed_s = max((sum(c.streamed.get(r, 0.0) for c in costs) for r in RESOURCES), default=0.0)
        return PlacementChange(
            step=step,
            streamed=streamed,
            to_gpu=to_gpu,
            to_host=to_host,
            host_s=host_s,
            streamed_s=streamed_s,
            planned_s=(current.step_time_s, chosen.step_time_s),
            rates=measured,
            order=self.order,
        )


def measured_rates(meter: InStepMeter) -> MeasuredRates:
    """The host AdamW's busy rate, the GPU's achieved rate and the streamed copies' PCIe rates over the
    steps ``meter`` summed (None where it timed none of that work)."""
    rates = meter.rates()
    if rates is None:
        return MeasuredRates(None, None)
    busy = next(iter(rates.cpu_adam_busy_gparams.values()), None)
    gpu = next(iter(rates.gpu_tflops.values()), None)
    pcie = rates.streamed_pcie_gbps
    return MeasuredRates(busy, gpu, pcie.get("h2d"), pcie.get("d2h"))


def _with_rates(inputs: Any, measured: MeasuredRates) -> Any:
    """``inputs``' bandwidths with ``measured`` laid over them, as :func:`~slide_hf.in_step_rates.learned_inputs`
    lays a cache's: the busy rate for the run's formats, the GPU's (this run's workload's by construction),
    and PCIe each way where the streamed copies reached less than the plan's rate."""
    changes: dict[str, Any] = {}
    bandwidths = inputs.bandwidths
    if measured.host_adam_gparams is not None:
        formats = (inputs.master_format, inputs.optimizer_state)
        kept = tuple(entry for entry in bandwidths.cpu_adam_busy_gparams if (entry[0], entry[1]) != formats)
        changes["cpu_adam_busy_gparams"] = (*kept, (*formats, measured.host_adam_gparams))
    if measured.gpu_tflops is not None:
        changes["gpu_tflops"] = measured.gpu_tflops
    pcie = {"h2d": measured.h2d_gbps, "d2h": measured.d2h_gbps}
    changes.update(slower_pcie(bandwidths, {key: value for key, value in pcie.items() if value is not None}))
    return dataclasses.replace(bandwidths, **changes)


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def compact_units(names: Iterable[str], order: Sequence[str] = ()) -> str:
    """Unit names in forward ``order`` (as given where ``order`` lacks one), runs of consecutive numbered
    units of one prefix written as a range: ``embedding, block.3-9, head``; ``none`` for no unit."""
    chosen = set(names)
    position = {name: index for index, name in enumerate(order)}
    ordered = sorted(chosen, key=lambda name: (position.get(name, len(position)), name))
    parts: list[str] = []
    run: list[tuple[str, int, str]] = []  # (prefix, number, name) of the current run

    def close() -> None:
        if len(run) > 1:
            parts.append(f"{run[0][2]}-{run[-1][1]}")
        elif run:
            parts.append(run[0][2])
        run.clear()

    for name in ordered:
        match = _NUMBERED.match(name)
        if match is None:
            close()
            parts.append(name)
            continue
        prefix, number = match.group(1), int(match.group(2))
        adjacent = run and run[-1][0] == prefix and run[-1][1] == number - 1
        if not adjacent:
            close()
        run.append((prefix, number, name))
    close()
    return ", ".join(parts) or "none"
