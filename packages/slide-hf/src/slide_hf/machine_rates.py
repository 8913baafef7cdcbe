"""This machine's measured rates: host memory, PCIe each way and both at once, the host AdamW per state and
master format, the GPU.

The planner's step time divides bytes and FLOPs by rates (:class:`slide_hf.planner.Bandwidths`), and the
choice of where each unit is updated (host or GPU-streamed, slide_hf/planner/update_placement.py) is only as
good as they are. The rates differ several-fold between machines (a desktop's dual-channel DDR4 against a
server's twelve channels; PCIe 4 against 5), so they are measured once per machine by `slide doctor` and
cached as JSON under the user cache directory (``$XDG_CACHE_HOME/slide``, else ``~/.cache/slide``), one
file per :class:`HostIdentity`: a home directory shared by several machines keeps one measurement each.

`slide plan` never measures (it runs in seconds, on any machine): it reads this machine's cache, or, without
one, uses the documented defaults of :class:`~slide_hf.planner.Bandwidths`, and says which
(:func:`planning_bandwidths`). Those defaults are a slow machine's (an 8B DPO step on an H100 host planned at
11.8 s where it takes 2.2 s), so the first `slide train` or `slide bench` on a GPU machine without a cache
measures it once, a few seconds before its plan, and caches what it measured (``measure_if_absent``): a
user who never ran `slide doctor` gets a placement and a plan line from this machine's rates. A cache file
that cannot be read is one logged line and counts as absent; `slide doctor` then measures again and
rewrites it. A version 1 file (written before the split-master and
duplex rates were measured) still loads, without them: planning uses their documented defaults.

Every measurement runs on random data (never zeros: a zero page can be shared, and a compressing memory
path would flatter it), over arrays large enough to leave the caches (:class:`MeasureSizes`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "TRAINING_MATMUL_SHARE",
    "HostIdentity",
    "MachineRates",
    "MeasureSizes",
    "cache_path",
    "load_cached",
    "measure_rates",
    "planning_bandwidths",
    "refresh_cached",
]

log = logging.getLogger("slide.machine_rates")

STATE_FORMATS = ("fp32", "bf16", "int8")
_CACHE_VERSION = 2
_READABLE_VERSIONS = (1, 2)
"""Version 2 added ``cpu_adam_split_gparams`` and ``pcie_duplex_gbps``; a version 1 file loads without them."""


@dataclass(frozen=True)
class HostIdentity:
    """What a measurement belongs to: the host's name, its CPU model and its GPU (``none`` without one).
    A GPU or CPU swapped under the same host name is a new machine and is measured afresh."""

    hostname: str
    cpu_model: str
    gpu_name: str

    @classmethod
    def here(cls) -> HostIdentity:
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        return cls(socket.gethostname(), _cpu_model(), gpu)

    def key(self) -> str:
        """A short file-name-safe digest of the identity."""
        text = "\0".join((self.hostname, self.cpu_model, self.gpu_name))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo on Linux, else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@dataclass(frozen=True)
class MeasureSizes:
    """How much each measurement moves. The defaults leave every cache (hundreds of MB per array) and
    take a few seconds in all; tests pass tiny ones."""

    host_numel: int = 64 << 20
    """fp32 elements per array of the copy and triad (256 MB each)."""
    adam_numel: int = 16 << 20
    """Parameters per AdamW step timed: master, gradient and moments are ~0.4 GB with fp32 state."""
    pcie_numel: int = 64 << 20
    """fp32 elements per PCIe transfer (256 MB, pinned)."""
    gpu_matmul: int = 8192
    """Side of the bf16 matmul whose rate is the GPU's compute rate."""
    reps: int = 3
    """Timed repetitions of each; the median is kept."""
    optimizer: str = "auto"
    """The ``slide.optimizers`` plugin timed (``auto``: what `slide train` would run here)."""
    state_formats: tuple[str, ...] = STATE_FORMATS


@dataclass(frozen=True)
class MachineRates:
    """Measured rates (GB/s are 1e9 bytes/s). ``None``: not measurable here (no CUDA GPU).

    - ``host_copy_gbps``, ``host_triad_gbps``: STREAM-style copy (8 B/element) and triad (12 B/element)
      over fp32 arrays, with torch's threads; the triad is the host memory bandwidth the planner uses.
    - ``cpu_adam_gparams``: host AdamW updates per second per state format, in 1e9 parameters/s, from a
      bf16 gradient as the engine hands it over (:meth:`cpu_adam_gbps` gives the bytes).
    - ``cpu_adam_split_gparams``: the same with a split master (slide_core/split_master.py), which the
      kernel decodes and encodes on every update; empty where the optimizer takes no split master.
    - ``h2d_gbps``, ``d2h_gbps``: pinned host memory to and from the GPU.
    - ``pcie_duplex_gbps``: h2d and d2h bytes together per second while both copy at once (two streams).
    - ``gpu_mem_gbps``: a device-to-device copy (what a GPU-side AdamW update is bound by).
    - ``gpu_tflops``: a bf16 matmul's rate: an upper bound on what training achieves (planning takes
      :data:`TRAINING_MATMUL_SHARE` of it).
    """

    identity: HostIdentity
    measured_at: str
    host_copy_gbps: float
    host_triad_gbps: float
    cpu_adam_gparams: Mapping[str, float] = field(default_factory=dict)
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    gpu_mem_gbps: float | None = None
    gpu_tflops: float | None = None
    cpu_adam_split_gparams: Mapping[str, float] = field(default_factory=dict)
    pcie_duplex_gbps: float | None = None

    def cpu_adam_gbps(self, state_format: str) -> float:
        """The host AdamW's memory traffic in GB/s with ``state_format``: the fused step's bytes per
        parameter (bf16 gradient 2, master 8, the moments read and written in their format) times its rate."""
        from slide_core.optim.compact_adamw import compact_bytes_per_param

        return self.cpu_adam_gparams[state_format] * compact_bytes_per_param(state_format)

    def bandwidths(self, defaults: Any = None) -> Any:
        """A :class:`~slide_hf.planner.Bandwidths` with every rate measured here, the rest ``defaults``'s
        (the disk, and the GPU's on a machine without one)."""
        from slide_hf.planner import Bandwidths

        base = defaults if defaults is not None else Bandwidths()
        changes: dict[str, Any] = {"host_mem_gbps": self.host_triad_gbps}
        if "fp32" in self.cpu_adam_gparams:
            changes["cpu_adam_gparams"] = self.cpu_adam_gparams["fp32"]
        changes["cpu_adam_state_gparams"] = tuple(sorted(self.cpu_adam_gparams.items()))
        changes["cpu_adam_split_state_gparams"] = tuple(sorted(self.cpu_adam_split_gparams.items()))
        for name in _OPTIONAL_RATES:
            value = getattr(self, name)
            if value is not None:
                changes[name] = value
        if self.gpu_tflops is not None:  # the planner divides by what training achieves, not the matmul's peak
            changes["gpu_tflops"] = self.gpu_tflops * TRAINING_MATMUL_SHARE
        return dataclasses.replace(base, **changes)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["cpu_adam_gparams"] = dict(self.cpu_adam_gparams)
        data["cpu_adam_split_gparams"] = dict(self.cpu_adam_split_gparams)
        return {"version": _CACHE_VERSION, **data}

    @classmethod
    def from_json(cls, data: Any) -> MachineRates:
        """Read :meth:`to_json`'s output back (or a version 1 file's, without the rates it lacks); anything
        else raises ``ValueError`` naming what is wrong."""
        if not isinstance(data, dict) or data.get("version") not in _READABLE_VERSIONS:
            raise ValueError(f"not a version {' or '.join(map(str, _READABLE_VERSIONS))} rates file")
        try:
            identity = HostIdentity(**data["identity"])
            adam = {str(k): _positive(v, f"cpu_adam_gparams.{k}") for k, v in dict(data["cpu_adam_gparams"]).items()}
            split = {
                str(k): _positive(v, f"cpu_adam_split_gparams.{k}")
                for k, v in dict(data.get("cpu_adam_split_gparams") or {}).items()
            }
            optional = {
                name: None if data.get(name) is None else _positive(data[name], name) for name in _OPTIONAL_RATES
            }
            return cls(
                identity=identity,
                measured_at=str(data["measured_at"]),
                host_copy_gbps=_positive(data["host_copy_gbps"], "host_copy_gbps"),
                host_triad_gbps=_positive(data["host_triad_gbps"], "host_triad_gbps"),
                cpu_adam_gparams=adam,
                cpu_adam_split_gparams=split,
                **optional,
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"missing or malformed field: {error}") from None


TRAINING_MATMUL_SHARE = 0.82
"""The share of ``slide doctor``'s matmul rate a step's GPU compute achieves (``Bandwidths.gpu_tflops`` is
the achieved rate). Measured on an H100 host (16 cores, 128 GiB), batch 16 x 1024, the engine's GPU busy
time against the plan's FLOPs at the doctor's 759.5 TFLOPS: llama3.1-8b 0.83-0.85 (host, streamed and
resident blocks), llama3.2-3b 0.77 (narrower layers, a larger share in attention and the loss);
docs/benchmarks.md, "Where each unit's update runs". Without it the plan's compute time was 17-30 % short."""

_OPTIONAL_RATES = ("h2d_gbps", "d2h_gbps", "gpu_mem_gbps", "gpu_tflops", "pcie_duplex_gbps")
"""The rates measured only with a CUDA GPU (None without one)."""


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


# -- measuring ---------------------------------------------------------------------------------------------
def measure_rates(sizes: MeasureSizes = MeasureSizes(), identity: HostIdentity | None = None) -> MachineRates:
    """Measure every rate this machine has (the GPU's only with a CUDA GPU). Takes a few seconds at the
    default sizes, plus the optimizer's compile on first use."""
    identity = identity or HostIdentity.here()
    copy_gbps, triad_gbps = _host_memory_gbps(sizes)
    adam = {fmt: _cpu_adam_gparams(fmt, sizes) for fmt in sizes.state_formats}
    split: dict[str, float] = {}
    if _takes_split_master(sizes.optimizer):
        split = {fmt: _cpu_adam_gparams(fmt, sizes, master_format="split") for fmt in sizes.state_formats}
    gpu: dict[str, float | None] = dict.fromkeys(_OPTIONAL_RATES)
    if torch.cuda.is_available():
        gpu = _gpu_rates(sizes)
    return MachineRates(
        identity=identity,
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        host_copy_gbps=copy_gbps,
        host_triad_gbps=triad_gbps,
        cpu_adam_gparams=adam,
        cpu_adam_split_gparams=split,
        **gpu,
    )


def _median_s(fn: Callable[[], object], reps: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median wall time of ``fn`` over ``reps`` runs after one untimed run. ``sync`` waits for the device
    (a CPU-GPU sync point, on purpose: the work must be done before the clock is read)."""
    fn()
    sync()
    times = []
    for _ in range(max(1, reps)):
        began = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - began)
    return max(statistics.median(times), 1e-9)


def _host_memory_gbps(sizes: MeasureSizes) -> tuple[float, float]:
    """STREAM copy ``a = b`` (8 B/element) and triad ``a = b + s*c`` (12 B/element), counted without
    write-allocate, as STREAM reports them."""
    generator = torch.Generator().manual_seed(0)
    n = sizes.host_numel
    a, b, c = (torch.rand(n, generator=generator) for _ in range(3))
    copy_s = _median_s(lambda: a.copy_(b), sizes.reps)
    triad_s = _median_s(lambda: torch.add(b, c, alpha=1.5, out=a), sizes.reps)
    return 8 * n / copy_s / 1e9, 12 * n / triad_s / 1e9


def _takes_split_master(name: str) -> bool:
    """Whether the ``name`` optimizer plugin steps a split master range (``Optimizer.split_master``)."""
    from slide_core import AdamWConfig
    from slide_core.optim import build_optimizer

    return bool(getattr(build_optimizer(name, AdamWConfig()), "split_master", False))


def _cpu_adam_gparams(state_format: str, sizes: MeasureSizes, master_format: str = "fp32") -> float:
    """Parameters per second (1e9) of the ``sizes.optimizer`` plugin stepping one range with
    ``state_format`` moments from a bf16 gradient, as the engine calls it; with ``master_format`` "split",
    on a split master range (bf16 plane, int16 low plane and tie bits) holding the same values."""
    from slide_core import AdamWConfig
    from slide_core.optim import build_optimizer
    from slide_core.optim.state_formats import encode_moments, state_arrays, stream_key
    from slide_core.split_master import SplitMaster, tie_bytes

    n = sizes.adam_numel
    generator = torch.Generator().manual_seed(1)
    master = torch.randn(n, generator=generator).mul_(0.02)
    grad = torch.randn(n, generator=generator).mul_(1e-2).to(torch.bfloat16)
    m = torch.randn(n, generator=generator).mul_(1e-3)
    v = torch.rand(n, generator=generator).mul_(1e-6).add_(1e-12)
    optimizer = build_optimizer(sizes.optimizer, AdamWConfig(weight_decay=0.1, state_format=state_format))
    if state_format == "fp32":
        state = {"exp_avg": m, "exp_avg_sq": v}
    else:
        state = {a.name: torch.empty(a.numel(n), dtype=a.dtype) for a in state_arrays(state_format)}
        encode_moments(state_format, m, v, state, index0=0, key=stream_key(0, 0))
    target: torch.Tensor | SplitMaster = master
    if master_format == "split":
        target = SplitMaster(
            torch.empty(n, dtype=torch.bfloat16),
            torch.empty(n, dtype=torch.int16),
            torch.zeros(tie_bytes(n), dtype=torch.uint8),
        )
        target.encode_(master)
    optimizer.reserve(n)
    count = [0]

    def step() -> None:
        count[0] += 1
        optimizer.step(target, grad, state, lr=1e-4, step=count[0], decay=True)

    return n / _median_s(step, sizes.reps) / 1e9


def _gpu_rates(sizes: MeasureSizes) -> dict[str, float | None]:
    """Pinned h2d and d2h, each alone and both at once, a device copy and a bf16 matmul on GPU 0."""
    device = torch.device("cuda", 0)
    sync = torch.cuda.synchronize
    n = sizes.pcie_numel
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    host.uniform_()
    on_device = torch.empty(n, dtype=torch.float32, device=device)
    h2d_s = _median_s(lambda: on_device.copy_(host, non_blocking=True), sizes.reps, sync)
    d2h_s = _median_s(lambda: host.copy_(on_device, non_blocking=True), sizes.reps, sync)
    duplex_s = _duplex_s(sizes, host, on_device)
    other = torch.rand(n, device=device)
    copy_s = _median_s(lambda: on_device.copy_(other), sizes.reps, sync)
    side = sizes.gpu_matmul
    x = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    y = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    matmul_s = _median_s(lambda: torch.mm(x, y), sizes.reps, sync)
    return {
        "h2d_gbps": 4 * n / h2d_s / 1e9,
        "d2h_gbps": 4 * n / d2h_s / 1e9,
        "pcie_duplex_gbps": 8 * n / duplex_s / 1e9,  # n fp32 elements each way
        "gpu_mem_gbps": 8 * n / copy_s / 1e9,  # read and write
        "gpu_tflops": 2 * side**3 / matmul_s / 1e12,
    }


def _duplex_s(sizes: MeasureSizes, host: torch.Tensor, on_device: torch.Tensor) -> float:
    """Seconds for an h2d copy of ``host`` into ``on_device`` and a d2h copy of another buffer of their
    size, issued at once on two CUDA streams: what GPU-streamed units do (master and moments coming in for
    one unit while another's go back)."""
    device = on_device.device
    source = torch.rand(on_device.numel(), device=device)
    back = torch.empty(on_device.numel(), dtype=on_device.dtype, pin_memory=True)
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    current = torch.cuda.current_stream(device)

    def both() -> None:
        for stream in streams:
            stream.wait_stream(current)
        with torch.cuda.stream(streams[0]):
            on_device.copy_(host, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            back.copy_(source, non_blocking=True)
        for stream in streams:
            current.wait_stream(stream)

    return _median_s(both, sizes.reps, torch.cuda.synchronize)


# -- the cache ---------------------------------------------------------------------------------------------
def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/slide``, else ``~/.cache/slide``."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "slide"


def cache_path(identity: HostIdentity, environ: Mapping[str, str] | None = None) -> Path:
    return cache_dir(environ) / f"machine-rates-{identity.key()}.json"


def load_cached(identity: HostIdentity | None = None, environ: Mapping[str, str] | None = None) -> MachineRates | None:
    """This machine's cached rates, or None without a cache. A file that cannot be read, is not JSON, or
    belongs to another identity is one logged line and counts as absent (the next `slide doctor` rewrites it)."""
    identity = identity or HostIdentity.here()
    path = cache_path(identity, environ)
    if not path.exists():
        return None
    try:
        rates = MachineRates.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as error:  # json.JSONDecodeError is a ValueError
        log.warning("ignoring the machine rates cache %s (%s); `slide doctor` measures again", path, _first_line(error))
        return None
    if rates.identity != identity:
        log.warning("ignoring the machine rates cache %s: it was measured on another machine", path)
        return None
    return rates


def refresh_cached(
    sizes: MeasureSizes = MeasureSizes(),
    identity: HostIdentity | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[MachineRates, Path]:
    """Measure now and replace this machine's cache (written to a temporary name, then renamed, so a
    reader never sees half a file). Returns the rates and where they were written."""
    identity = identity or HostIdentity.here()
    rates = measure_rates(sizes, identity)
    path = cache_path(identity, environ)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(rates.to_json(), indent=1), encoding="utf-8")
    partial.replace(path)
    return rates, path


def planning_bandwidths(
    defaults: Any = None,
    identity: HostIdentity | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    measure_if_absent: bool = False,
    sizes: MeasureSizes = MeasureSizes(),
) -> tuple[Any, str]:
    """``(Bandwidths, where they come from)`` for planning here: this machine's cached measurement, or
    ``defaults`` (the documented :class:`~slide_hf.planner.Bandwidths` defaults) without one. With
    ``measure_if_absent`` (a training run on a GPU), a machine with no cache is measured now at ``sizes``
    and the cache written, as `slide doctor` would; a measurement that fails is one logged line, and the
    defaults plan the run."""
    from slide_hf.planner import Bandwidths

    base = defaults if defaults is not None else Bandwidths()
    rates = load_cached(identity, environ)
    if rates is None and measure_if_absent:
        log.info("this machine's rates are not cached: measuring them once (a few seconds; `slide doctor` shows them)")
        try:
            rates, path = refresh_cached(sizes, identity, environ)
        except (OSError, RuntimeError, ValueError) as error:  # a full disk, a busy GPU: plan from the defaults
            log.warning(
                "measuring this machine's rates failed (%s); planning with the documented defaults", _first_line(error)
            )
        else:
            return rates.bandwidths(base), f"measured here {rates.measured_at}, before this run (cached in {path})"
        finally:
            _release_measurement_memory()
    if rates is None:
        return base, "documented defaults (no measurement of this machine cached; `slide doctor` measures it)"
    return rates.bandwidths(base), f"measured here {rates.measured_at} (cached; `slide doctor` measures again)"


def _release_measurement_memory() -> None:
    """Give back what a measurement inside a run cached: the CUDA allocator's device blocks and the pinned
    host blocks of its transfers (torch keeps both for reuse), which the run's plan does not price: its
    GPU and host peaks stay the run's own."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if host_empty_cache is not None:
            host_empty_cache()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
