"""Rates a training run measures inside its own steps, kept per machine so the next plan there uses them.

`slide doctor` times each rate alone (slide_hf/machine_rates.py); inside a step the same work runs slower or
faster: the host AdamW shares memory bandwidth with the DMA and its cores with the engine's threads (1.1 to
1.8x below its stand-alone rate on an H100 and an H200 host), and the GPU's achieved FLOP rate depends on the
model's widths, the sequence and the batch. A plan built from stand-alone rates is therefore off by host,
which is what "the plan is not the run" measured. So `slide train` and `slide bench` time each term in their
steps after the first (:class:`InStepMeter`, from the engine's per-unit spans), report it beside the plan's
figure, and write the rates to this machine's cache (:class:`InStepRates`, one JSON file per
:class:`~slide_hf.machine_rates.HostIdentity`, beside the doctor's). The next plan on this machine lays them
over its bandwidths (:func:`learned_inputs`):

- the host AdamW's *busy* rate, per master and state format: parameters of the host-updated units over the
  seconds of their update spans (the schedule models the optimizer's idle time itself);
- the GPU's achieved rate, per workload (the model's shape, micro-batch, sequence and compute dtype): the
  plan's FLOPs per step over the seconds of the forward, backward and head spans;
- PCIe each way as the GPU-streamed units' copies reach it (``h2d``, ``d2h``): the bytes of their uploads
  (master and moments into a staging set) and write-backs over the seconds of those spans (the engine's
  ``upload`` and ``write_back`` phases, streamed_pipeline.py);
- a checkpoint's write, per file system (its mount point, :func:`~slide_hf.planner.output_disk.disk_key`):
  a save in the foreground's bytes over its seconds, files synced (:func:`learn_checkpoint_write`), which
  prices the next plan's saves on that disk (slide_hf/planner/save_cost.py) where `slide doctor`, which
  never measures the output disk, leaves the planner's assumed disk rate.

A copy's span on its stream includes the time it shares the link with the other direction's, so the
PCIe rate measured in steps is the rate the streamed copies reach *under load*, not the link's alone.
It is laid over the plan's rates only where it is slower than them (:func:`learned_inputs`): a host
whose PCIe is slower in its steps than `slide doctor` measured it then streams fewer units, and one
whose copies share the link well keeps the doctor's rates and the plan's duplex term for the sharing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from slide_hf import machine_rates
from slide_hf.machine_rates import HostIdentity

__all__ = [
    "PCIE_DIRECTIONS",
    "InStepMeter",
    "InStepRates",
    "MeasuredTerms",
    "checkpoint_write_gbps",
    "learn_checkpoint_write",
    "learn_rates",
    "learned_inputs",
    "slower_pcie",
    "workload_key",
]

log = logging.getLogger("slide.in_step_rates")

_VERSION = 1
_MIN_WRITE_BYTES = 64 << 20
"""A smaller checkpoint's write time is mostly the fixed cost of files and syncs, not the disk's rate."""
_COMPUTE_PHASES = ("forward", "backward", "head")
PCIE_DIRECTIONS = {"h2d": "upload", "d2h": "write_back"}
"""A PCIe direction's key in :attr:`InStepRates.streamed_pcie_gbps` to the engine's phase that times it."""
_MIN_SPAN_S = 1e-4
"""Span totals below this are too short to trust as a rate (timer resolution)."""


def workload_key(inputs: Any) -> str:
    """What the GPU's achieved rate belongs to: the model's shape, the micro-batch, the sequence, the
    accumulation and the compute dtype (a short digest; two runs of one model at one batch share it)."""
    shape = inputs.shape
    parts = (
        shape.hidden_size,
        shape.num_blocks,
        shape.block_params,
        shape.vocab_size,
        shape.num_heads,
        shape.head_dim,
        inputs.batch_size,
        inputs.seq_len,
        inputs.grad_accum,
        inputs.compute_dtype_bytes,
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class InStepRates:
    """Rates measured inside training steps on one machine.

    - ``cpu_adam_busy_gparams``: ``"master/state"`` (e.g. ``"split/bf16"``) to the host AdamW's busy rate,
      1e9 parameters/s;
    - ``gpu_tflops``: :func:`workload_key` to the achieved rate, 1e12 FLOP/s of the plan's count;
    - ``streamed_pcie_gbps``: ``"h2d"`` and ``"d2h"`` to the rate the GPU-streamed units' uploads and
      write-backs reached, GB/s (a file written before they were measured has none);
    - ``checkpoint_write_gbps``: a file system's mount point to the rate a checkpoint was written there,
      GB/s (none in a file written before);
    - ``measured_at``: when the newest of them was measured.
    """

    identity: HostIdentity
    measured_at: str
    cpu_adam_busy_gparams: Mapping[str, float] = field(default_factory=dict)
    gpu_tflops: Mapping[str, float] = field(default_factory=dict)
    streamed_pcie_gbps: Mapping[str, float] = field(default_factory=dict)
    checkpoint_write_gbps: Mapping[str, float] = field(default_factory=dict)

    def merged(self, newer: InStepRates) -> InStepRates:
        """These rates with ``newer``'s replacing the ones they measure again (the rest kept)."""
        return InStepRates(
            identity=self.identity,
            measured_at=newer.measured_at,
            cpu_adam_busy_gparams={**self.cpu_adam_busy_gparams, **newer.cpu_adam_busy_gparams},
            gpu_tflops={**self.gpu_tflops, **newer.gpu_tflops},
            streamed_pcie_gbps={**self.streamed_pcie_gbps, **newer.streamed_pcie_gbps},
            checkpoint_write_gbps={**self.checkpoint_write_gbps, **newer.checkpoint_write_gbps},
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "version": _VERSION,
            "identity": dataclasses.asdict(self.identity),
            "measured_at": self.measured_at,
            "cpu_adam_busy_gparams": dict(self.cpu_adam_busy_gparams),
            "gpu_tflops": dict(self.gpu_tflops),
            "streamed_pcie_gbps": dict(self.streamed_pcie_gbps),
            "checkpoint_write_gbps": dict(self.checkpoint_write_gbps),
        }

    @classmethod
    def from_json(cls, data: Any) -> InStepRates:
        """Read :meth:`to_json`'s output back; anything else raises ``ValueError`` naming what is wrong."""
        if not isinstance(data, dict) or data.get("version") != _VERSION:
            raise ValueError(f"not a version {_VERSION} in-step rates file")
        try:
            return cls(
                identity=HostIdentity(**data["identity"]),
                measured_at=str(data["measured_at"]),
                cpu_adam_busy_gparams=_rates(data["cpu_adam_busy_gparams"], "cpu_adam_busy_gparams"),
                gpu_tflops=_rates(data["gpu_tflops"], "gpu_tflops"),
                streamed_pcie_gbps=_rates(data.get("streamed_pcie_gbps", {}), "streamed_pcie_gbps"),
                checkpoint_write_gbps=_rates(data.get("checkpoint_write_gbps", {}), "checkpoint_write_gbps"),
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"missing or malformed field: {error}") from None

    # -- the cache ---------------------------------------------------------------------------------------
    @staticmethod
    def path(identity: HostIdentity, environ: Mapping[str, str] | None = None) -> Path:
        return machine_rates.cache_dir(environ) / f"in-step-rates-{identity.key()}.json"  # beside the doctor's

    @classmethod
    def load(cls, identity: HostIdentity, environ: Mapping[str, str] | None = None) -> InStepRates | None:
        """This machine's in-step rates, or None without any. A file that cannot be read, or belongs to
        another machine, is one logged line and counts as absent (the next run's measurement replaces it)."""
        path = cls.path(identity, environ)
        if not path.exists():
            return None
        try:
            rates = cls.from_json(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as error:
            log.warning("ignoring the in-step rates cache %s (%s); the next run measures again", path, error)
            return None
        if rates.identity != identity:
            log.warning("ignoring the in-step rates cache %s: it was measured on another machine", path)
            return None
        return rates

    def save(self, environ: Mapping[str, str] | None = None) -> Path:
        """Merge into this machine's cache file (written to a temporary name, then renamed, so a reader
        never sees half a file; two runs ending at once each leave a whole file)."""
        older = InStepRates.load(self.identity, environ)
        rates = older.merged(self) if older is not None else self
        path = InStepRates.path(self.identity, environ)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(rates.to_json(), indent=1), encoding="utf-8")
        partial.replace(path)
        return path


def _rates(value: Any, name: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object")
    out = {}
    for key, rate in value.items():
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < float("inf"):
            raise ValueError(f"{name}.{key} must be a positive finite number, got {rate!r}")
        out[str(key)] = float(rate)
    return out


def learned_inputs(
    inputs: Any, identity: HostIdentity | None = None, environ: Mapping[str, str] | None = None
) -> tuple[Any, str | None]:
    """``inputs`` with this machine's in-step rates laid over its bandwidths, and a phrase naming what was
    taken (None: nothing measured here yet). The host AdamW's busy rates apply to every workload; the GPU's
    achieved rate only to the workload it was measured on (:func:`workload_key`); the streamed copies'
    PCIe rates to every workload, each direction only where slower than the plan's (:func:`slower_pcie`)."""
    identity = identity or HostIdentity.here()
    rates = InStepRates.load(identity, environ)
    if rates is None:
        return inputs, None
    busy = tuple(
        (key.split("/", 1)[0], key.split("/", 1)[1], value)
        for key, value in sorted(rates.cpu_adam_busy_gparams.items())
        if "/" in key
    )
    changes: dict[str, Any] = {"cpu_adam_busy_gparams": busy}
    taken = ["the host AdamW's"] if busy else []
    gpu = rates.gpu_tflops.get(workload_key(inputs))
    if gpu is not None:
        changes["gpu_tflops"] = gpu
        taken.append("the GPU's on this workload")
    pcie = slower_pcie(inputs.bandwidths, rates.streamed_pcie_gbps)
    if pcie:
        changes.update(pcie)
        taken.append("PCIe's (" + ", ".join(f"{key[:3]} {value:.3g} GB/s" for key, value in pcie.items()) + ")")
    if not taken:
        return inputs, None
    bandwidths = dataclasses.replace(inputs.bandwidths, **changes)
    return dataclasses.replace(inputs, bandwidths=bandwidths), (
        f"{' and '.join(taken)} rates measured in steps here {rates.measured_at}"
    )


def learn_checkpoint_write(
    directory: Path, nbytes: int, seconds: float, environ: Mapping[str, str] | None = None
) -> float | None:
    """Keep the rate a checkpoint of ``nbytes`` was written at in ``seconds`` into ``directory``, for the
    plans of saves on its file system (a checkpoint under 64 MiB, or a cache that cannot be written, keeps
    nothing: the run does not depend on it). Returns the rate in GB/s, if kept."""
    from slide_hf.planner.output_disk import disk_key

    if nbytes < _MIN_WRITE_BYTES or seconds <= 0:
        return None
    rate = nbytes / seconds / 1e9
    rates = InStepRates(
        identity=HostIdentity.here(),
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        checkpoint_write_gbps={disk_key(directory): rate},
    )
    try:
        rates.save(environ)
    except OSError as error:
        log.warning("could not keep the checkpoint write rate measured here (%s)", error)
        return None
    return rate


def checkpoint_write_gbps(directory: Path, environ: Mapping[str, str] | None = None) -> float | None:
    """The rate a run of this machine wrote a checkpoint at on ``directory``'s file system, GB/s; None
    where none was measured."""
    from slide_hf.planner.output_disk import disk_key

    rates = InStepRates.load(HostIdentity.here(), environ)
    return None if rates is None else rates.checkpoint_write_gbps.get(disk_key(directory))


def slower_pcie(bandwidths: Any, measured: Mapping[str, float]) -> dict[str, float]:
    """``Bandwidths`` fields (``h2d_gbps``, ``d2h_gbps``) to lay ``measured`` (the streamed copies' rates
    by direction, GB/s) over: each direction where it is slower than ``bandwidths``' rate. A faster one is
    left out: a span under load never times the link faster than alone, so it would only be noise."""
    changes = {}
    for direction in PCIE_DIRECTIONS:
        rate = measured.get(direction)
        field_name = f"{direction}_gbps"
        if rate is not None and rate < getattr(bandwidths, field_name):
            changes[field_name] = rate
    return changes


@dataclass(frozen=True)
class MeasuredTerms:
    """Per step, measured and planned: the host AdamW's busy seconds, the GPU's compute seconds, and the
    seconds of the GPU-streamed units' uploads and write-backs (planned: their bytes at the plan's PCIe
    rate each way); None where the run has none of that work."""

    host_update_s: float | None
    planned_host_update_s: float | None
    gpu_compute_s: float | None
    planned_gpu_compute_s: float | None
    streamed_h2d_s: float | None = None
    planned_streamed_h2d_s: float | None = None
    streamed_d2h_s: float | None = None
    planned_streamed_d2h_s: float | None = None

    def line(self) -> str:
        parts = []
        for name, measured, planned in (
            ("GPU compute", self.gpu_compute_s, self.planned_gpu_compute_s),
            ("host AdamW busy", self.host_update_s, self.planned_host_update_s),
            ("streamed upload", self.streamed_h2d_s, self.planned_streamed_h2d_s),
            ("streamed write-back", self.streamed_d2h_s, self.planned_streamed_d2h_s),
        ):
            if measured is not None and planned:
                parts.append(f"{name} {measured:.3g} s / {planned:.3g} s (x{measured / planned:.2f})")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, dict[str, float | None]]:
        terms = {
            "gpu_compute_s": (self.gpu_compute_s, self.planned_gpu_compute_s),
            "host_update_busy_s": (self.host_update_s, self.planned_host_update_s),
            "streamed_h2d_s": (self.streamed_h2d_s, self.planned_streamed_h2d_s),
            "streamed_d2h_s": (self.streamed_d2h_s, self.planned_streamed_d2h_s),
        }
        return {
            name: {"measured": measured, "planned": planned, "ratio": measured / planned if planned else None}
            for name, (measured, planned) in terms.items()
            if measured is not None
        }


class InStepMeter:
    """Sums a run's per-unit spans over its steps after the first, against the plan that placed it.

    ``plan``: the placed plan (its inputs give the layout: which units the host updates, and its FLOPs per
    step). Feed it each step's :meth:`Engine.unit_times` (:meth:`add`); :meth:`terms` and :meth:`rates`
    then give the per-step figures and the rates to cache. A run that moves units between the host and
    the GPU-streamed update says so (:meth:`placed`), so that only the host's spans count as the host
    AdamW's; the streamed units' uploads and write-backs count wherever they ran (their spans carry the
    bytes they moved). Holds sums only: nothing grows with the steps."""

    def __init__(self, plan: Any, *, warmup_steps: int = 1) -> None:
        inputs = plan.inputs
        layout = inputs.layout()
        # Units whose update spans time the host AdamW alone: host-updated, state in the host slabs (a tier
        # read would count the disk), and one contribution per step (an accumulator's sums would count too).
        plain = set(layout.sliding) & set(layout.state_in_host_slabs) - set(layout.accumulating(inputs.grad_accum))
        self._plain = {name: layout.numel[name] for name in plain if layout.numel[name] > 0}
        self._host_units: dict[str, int] = {}
        self.placed(layout.streamed)
        self._formats = f"{inputs.master_format}/{inputs.optimizer_state}"
        self._flops = float(plan.flops_per_step)
        self._workload = workload_key(inputs)
        self._planned_busy_rate = inputs.bandwidths.cpu_adam_busy_rate(inputs.optimizer_state, inputs.master_format)
        self._planned_tflops = inputs.bandwidths.gpu_tflops
        self._planned_gbps = {"h2d": inputs.bandwidths.h2d_gbps, "d2h": inputs.bandwidths.d2h_gbps}
        self._warmup = warmup_steps
        self._seen = 0
        self._steps = 0
        self._update_s = 0.0
        self._host_numel = 0  # host-updated parameters summed over the measured steps
        self._compute_s = 0.0
        self._pcie_s = dict.fromkeys(PCIE_DIRECTIONS, 0.0)  # streamed copies' span seconds, per direction
        self._pcie_bytes = dict.fromkeys(PCIE_DIRECTIONS, 0.0)

    def placed(self, streamed: Iterable[str]) -> None:
        """From the next step on, the units in ``streamed`` are updated on the GPU as they stream, every
        other one on the host (slide_hf/replacement.py): a streamed unit's update span is the GPU's."""
        on_gpu = set(streamed)
        self._host_units = {name: numel for name, numel in self._plain.items() if name not in on_gpu}

    @property
    def steps(self) -> int:
        """Steps measured so far (those after the warm-up)."""
        return self._steps

    def add(self, times: Mapping[str, Any]) -> None:
        """One step's per-unit times (:class:`~slide_core.engine.timeline.UnitTimes`, milliseconds)."""
        self._seen += 1
        if self._seen <= self._warmup:
            return
        self._steps += 1
        self._update_s += _sum_ms(times, self._host_units, ("update",)) / 1e3
        self._host_numel += sum(self._host_units.values())
        self._compute_s += _sum_ms(times, None, _COMPUTE_PHASES) / 1e3
        for direction, phase in PCIE_DIRECTIONS.items():
            self._pcie_s[direction] += _sum_ms(times, None, (phase,)) / 1e3
            self._pcie_bytes[direction] += sum(_bytes(unit_times, phase) for unit_times in times.values())

    def terms(self) -> MeasuredTerms | None:
        """Per-step means of the measured steps beside the plan's figures; None before a measured step."""
        if self._steps == 0:
            return None
        host_numel = self._host_numel / self._steps  # per step (the same in every step of one placement)
        measured_update = self._update_s / self._steps if host_numel else None
        measured_compute = self._compute_s / self._steps if self._compute_s > 0 else None
        pcie: dict[str, tuple[float | None, float | None]] = {}
        for direction in PCIE_DIRECTIONS:
            moved, seconds = self._pcie_bytes[direction], self._pcie_s[direction]
            if moved > 0 and seconds > 0:
                pcie[direction] = (seconds / self._steps, moved / self._steps / (self._planned_gbps[direction] * 1e9))
            else:
                pcie[direction] = (None, None)
        return MeasuredTerms(
            host_update_s=measured_update,
            planned_host_update_s=host_numel / (self._planned_busy_rate * 1e9) if host_numel else None,
            gpu_compute_s=measured_compute,
            planned_gpu_compute_s=self._flops / (self._planned_tflops * 1e12),
            streamed_h2d_s=pcie["h2d"][0],
            planned_streamed_h2d_s=pcie["h2d"][1],
            streamed_d2h_s=pcie["d2h"][0],
            planned_streamed_d2h_s=pcie["d2h"][1],
        )

    def pcie_gbps(self) -> dict[str, float]:
        """The streamed copies' achieved rate each way (GB/s) over the measured steps: their bytes over
        their spans' seconds; a direction without copies, or too little of them to time, is left out."""
        return {
            direction: self._pcie_bytes[direction] / self._pcie_s[direction] / 1e9
            for direction in PCIE_DIRECTIONS
            if self._pcie_bytes[direction] > 0 and self._pcie_s[direction] > _MIN_SPAN_S
        }

    def rates(self, identity: HostIdentity | None = None) -> InStepRates | None:
        """The rates these steps measured (None: none measured, or a span total too small to trust)."""
        terms = self.terms()
        if terms is None:
            return None
        busy = {}
        if terms.host_update_s is not None and terms.host_update_s > _MIN_SPAN_S:
            busy[self._formats] = self._host_numel / self._update_s / 1e9
        gpu = {}
        if terms.gpu_compute_s is not None and terms.gpu_compute_s > _MIN_SPAN_S:
            gpu[self._workload] = self._flops / terms.gpu_compute_s / 1e12
        pcie = self.pcie_gbps()
        if not busy and not gpu and not pcie:
            return None
        return InStepRates(
            identity=identity or HostIdentity.here(),
            measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
            cpu_adam_busy_gparams=busy,
            gpu_tflops=gpu,
            streamed_pcie_gbps=pcie,
        )


def learn_rates(meter: InStepMeter, environ: Mapping[str, str] | None = None) -> Path | None:
    """Write the rates ``meter`` measured to this machine's cache and say so in one line (a cache that
    cannot be written is one warning: the run's results do not depend on it). Returns the file, if written."""
    rates = meter.rates()
    if rates is None:
        return None
    try:
        path = rates.save(environ)
    except OSError as error:
        log.warning(
            "could not keep the rates measured in this run's steps (%s); plans here use the stand-alone ones", error
        )
        return None
    measured = [f"host AdamW {k} {v:.2f} Gparam/s busy" for k, v in rates.cpu_adam_busy_gparams.items()]
    measured += [f"GPU {v:.0f} TFLOPS on this workload" for v in rates.gpu_tflops.values()]
    measured += [f"streamed {k} {v:.3g} GB/s" for k, v in rates.streamed_pcie_gbps.items()]
    log.info(
        "rates measured in the steps (%s) kept in %s: the next plan on this machine uses them",
        ", ".join(measured),
        path,
    )
    return path


def _sum_ms(times: Mapping[str, Any], units: Iterable[str] | None, phases: tuple[str, ...]) -> float:
    names = times.keys() if units is None else [name for name in units if name in times]
    return sum(times[name].ms.get(phase, 0.0) for name in names for phase in phases)


def _bytes(unit_times: Any, phase: str) -> float:
    moved = getattr(unit_times, "bytes", None)  # spans recorded without their bytes count none
    return float(moved.get(phase, 0.0)) if moved is not None else 0.0
