"""Timed training steps on a preset or model directory, and the plain-PyTorch reference beside them.

Used by `slide bench` and `bench/e2e.py`. The engine is set up exactly as `slide train` sets up its own
(slide_hf/setup.py: the same device, optimizer and tier plugins, plan check and placement). Inputs are random
token ids (never zeros). Reported numbers:
- tok/s and TFLOPS, with FLOPs per token = 6·N + 12·L·H·S (matmuls fwd+bwd plus attention scores);
  the engine's recompute forward is *not* counted, so both sides are credited the same work;
- GPU peak (``max_memory_allocated``) and host peak RSS (sampled every 50 ms);
- per unit, overlap = T_bwd / (T_d2h + T_update) and the phase times behind it;
- the physical bound of the run: the largest of the summed per-unit compute, the PCIe time (bytes moved
  over the PCIe bandwidth measured in the same run) and the host optimizer time; and which one binds;
- the critical batch, the batch size at which the median block's overlap reaches 1 (overlap grows linearly with
  tokens per step, since T_bwd does and T_d2h + T_update do not);
- measured against predicted (:func:`measured_against_predicted`): the step and each bound beside the plan's
  time for it, the plan using this machine's cached rates when `slide doctor` measured them.
The plain reference is the HF model entirely on the GPU: fp32 weights, bf16 autocast, gradient
checkpointing, fused GPU AdamW, the same batch and sequence length, and the attention the engine runs
(chosen per layer type and device, slide_hf/adapters/attention.py: SDPA, or flex for Gemma 2's capped
logits).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import psutil
import torch

from slide_hf.defaults import resolve_seq_len
from slide_hf.errors import UserError
from slide_hf.in_step_rates import InStepMeter, learn_rates
from slide_hf.options import TrainConfig
from slide_hf.planner.traffic import h2d_bytes_per_param, host_bytes_per_param_step
from slide_hf.replacement import Replacement, compact_units
from slide_hf.setup import RunOptions, flops_per_token, make_device, make_optimizer, open_engine, place_units

if TYPE_CHECKING:
    from slide_hf.adapters.base import HFCausalLM

log = logging.getLogger("slide.bench")

__all__ = ["BenchConfig", "describe_unit", "measured_against_predicted", "run_bench", "write_trace"]


@dataclass(frozen=True)
class BenchConfig:
    """A benchmark: the run it times, as `slide train` would run it, and how it is timed and reported.

    ``options`` are the options `slide bench` shares with `slide train`, checked by the same rules
    (``TrainConfig.for_command("bench", ...)``, slide_hf/options); the engine takes them through
    :meth:`RunOptions.from_config`, as `slide train`'s recipe does, so no option is copied here by hand."""

    options: TrainConfig
    warmup: int = 2
    resident_gib: float | None = None  # None: whatever the GPU budget leaves (as `slide train` does)
    compare_plain: bool = False
    trace_dir: Path | None = None
    report_grad_norm: bool = True
    layers: int | None = None  # the model's first `layers` decoder layers only (slide_hf/truncate.py)

    def run_options(self) -> RunOptions:
        """The engine options a `slide train` run with the same flags would use (``seq_len`` resolved)."""
        options = RunOptions.from_config(self.options, report_grad_norm=self.report_grad_norm)
        return dataclasses.replace(options, packed_rows=False)  # one random sequence per row (_batches)


class PeakRss:
    """Samples this process's RSS every 50 ms on its own thread (a context manager)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        process = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, process.memory_info().rss)
            time.sleep(0.05)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _batches(vocab: int, batch: int, seq: int, count: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(1, vocab, (batch, seq), generator=generator)
        out.append([(ids, ids.clone())])
    return out


def _pcie_gbps(device: Any) -> tuple[float, float]:
    """Pinned h2d and d2h bandwidth measured now, on 1 GiB of random bytes."""
    if not device.is_accelerator:
        return float("inf"), float("inf")
    host = device.alloc_pinned(2**28, torch.float32)
    host.uniform_()
    target = torch.empty_like(host, device=device.torch_device)
    rates = []
    for src, dst in ((host, target), (target, host)):
        dst.copy_(src, non_blocking=True)
        device.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        device.synchronize()
        rates.append(3 * src.numel() * 4 / (time.perf_counter() - start) / 1e9)
    del target
    return rates[0], rates[1]


def run_engine(cfg: BenchConfig, config: Any) -> dict[str, Any]:
    from slide_core import AdamWConfig, HostParameters
    from slide_hf import build_model, init_random
    from slide_hf.adapters import attention_summary

    assert cfg.options.seq_len is not None and cfg.options.steps is not None  # resolved by run_bench; declared
    model = build_model(config)
    params = sum(u.layout.param_numel for u in model.units)
    options = cfg.run_options()
    device = make_device(options.device, options.gpu_memory_bytes)
    # Refuse, in one line with the fix to try, a run the host cannot hold (rather than be OOM-killed); place
    # units as `slide train` would, or within --resident-gib.
    resident_bytes = None if cfg.resident_gib is None else int(cfg.resident_gib * 2**30)
    placement = place_units(
        model, device, options, resident_bytes=resident_bytes, replaceable=True, measure_machine=True
    )
    plan, resident, offloaded = placement.plan, placement.resident, placement.offloaded
    # The delta rule delta-net layers run here, decided (a check on the GPU) and logged before the engine.
    owner = getattr(model, "linear_attention", None)
    linear = owner.path_for(device.torch_device, options.compute_dtype) if owner is not None else None
    batches = _batches(config.vocab_size, cfg.options.batch_size, cfg.options.seq_len, cfg.options.steps)
    times, losses, spans, norms = [], [], [], []
    per_unit: dict[str, list[dict[str, float]]] = {}
    meter = InStepMeter(plan, warmup_steps=cfg.warmup)  # each term against the plan, the rates kept for the next
    # --update-placement auto: units move from the rates the steps measure (slide_hf/replacement.py)
    replacement = Replacement(plan, warmup_steps=cfg.warmup) if Replacement.wanted(plan) else None
    streamed_per_step: list[str] = []  # the units each step updated on the GPU as they streamed (compact)
    order = tuple(unit.name for unit in model.units)
    with PeakRss() as rss, device:
        h2d_gbps, d2h_gbps = _pcie_gbps(device)
        began = time.perf_counter()
        optimizer = make_optimizer(options.optimizer, AdamWConfig(state_format=options.optimizer_state))
        master_format = placement.plan.inputs.master_format  # as the plan resolved --master (and priced it)
        host = HostParameters(model, master_format=master_format)  # as `slide train`: pins what it streams
        init_random(model, host, config, seed=0)
        setup_s = time.perf_counter() - began
        parts = open_engine(model, device, host, optimizer, options, placement, scratch=_scratch(cfg))
        with parts as engine:
            device.reset_peak_memory()
            # --trace: the last two steps, and the boundary between them, where the second step's first
            # loads wait for the first one's updates (the tracing starts idle, so one step alone shows no
            # such wait).
            first_traced = max(0, len(batches) - 2)
            for index, micro in enumerate(batches):
                traced = cfg.trace_dir is not None and index == len(batches) - 1
                if cfg.trace_dir is not None and index == first_traced:
                    engine.wait_idle()
                    engine.timeline.begin_trace(device.record_event("compute", timing=True))
                device.synchronize()
                start = time.perf_counter()
                stepped = engine.step(micro, lr=1e-5)
                if traced:
                    engine.wait_idle()
                times.append(time.perf_counter() - start)
                losses.append(stepped.loss)
                # A line a step: a long step (an 8B at 128K tokens: a minute) shows it ran, and how far a
                # run cut short by its caller's timeout got.
                log.info("step %d/%d: %.2f s", index + 1, len(batches), times[-1])
                norms.append(stepped.grad_norm)
                if traced:
                    spans = engine.timeline.end_trace()
                taken = engine.unit_times()
                meter.add(taken)
                streamed_per_step.append(compact_units(engine.streamed_units, order))
                if replacement is not None and replacement.after_step(index + 1, taken, engine) is not None:
                    meter.placed(replacement.streamed)
                if index >= cfg.warmup:
                    for name, t in taken.items():
                        per_unit.setdefault(name, []).append(dict(t.ms))
            gpu_peak = device.peak_memory_bytes()
            # As `slide train` ends: the host optimizer state goes before the resident masters come back.
            engine.close(keep_host_state=False)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = getattr(text_config, "num_experts_per_tok", None)
    unit_facts = {unit.name: describe_unit(unit, top_k) for unit in model.units}
    terms = meter.terms()
    if device.is_accelerator:
        learn_rates(meter)
    steady = times[cfg.warmup :] or times
    step_s = statistics.median(steady)
    # Each measured step's plan: deferred after a step that clipped (Plan.expected_step_s).
    norm_before = [None, *norms[:-1]]  # the norm of the step before each step
    before_steady = norm_before[cfg.warmup :] or norm_before
    planned_step_s = plan.expected_step_s(before_steady, cfg.options.max_grad_norm)
    tokens = cfg.options.batch_size * cfg.options.seq_len
    units = {}
    for name, records in per_unit.items():
        keys = sorted({k for r in records for k in r})
        phases = {k: round(statistics.mean(r.get(k, 0.0) for r in records), 2) for k in keys}
        busy = phases.get("backward", 0.0) + phases.get("head", 0.0)
        cost = phases.get("d2h", 0.0) + (0.0 if name in resident else phases.get("update", 0.0))
        units[name] = {
            "overlap": round(busy / cost, 3) if cost else None,
            "resident": name in resident,
            **unit_facts[name],
            **phases,
        }
    compute_ms = sum(u.get(k, 0.0) for u in units.values() for k in ("forward", "backward", "head"))
    host_update_ms = sum(u.get("update", 0.0) for n, u in units.items() if n not in resident)
    sliding_numel = sum(u.layout.numel for u in model.units if u.name not in resident)
    loads_bytes = 2 * sliding_numel * h2d_bytes_per_param(master_format)  # master h2d, forward and backward
    grads_bytes = sliding_numel * 2
    pcie_ms = (loads_bytes / h2d_gbps + grads_bytes / d2h_gbps) / 1e6
    bounds = {"gpu compute": compute_ms, "pcie": pcie_ms, "host optimizer": host_update_ms}
    binding = max(bounds, key=bounds.__getitem__)
    block_overlaps = [u["overlap"] for n, u in units.items() if n.startswith("block") and u["overlap"]]
    median_overlap = statistics.median(block_overlaps) if block_overlaps else None
    flops = flops_per_token(config, params, cfg.options.seq_len)
    result = {
        "params": params,
        "resident_units": list(resident),
        "nvme_state_units": list(offloaded),
        "planned_disk_bytes": plan.disk_bytes,
        "optimizer": type(optimizer).__name__,
        "master_format": master_format,
        "host_bytes_per_param_step": {
            fmt: host_bytes_per_param_step(fmt, options.optimizer_state, 2) for fmt in ("fp32", "split")
        },
        "max_grad_norm": cfg.options.max_grad_norm,
        "grad_norms": [None if r is None else round(r, 4) for r in norms],
        "setup_s": round(setup_s, 1),
        "step_s": round(step_s, 4),
        "step_times_s": [round(t, 4) for t in times],
        "tokens_per_s": round(tokens / step_s, 1),
        "tflops": round(flops * tokens / step_s / 1e12, 1),
        "gpu_peak_gib": round(gpu_peak / 2**30, 2),
        "planned_gpu_peak_gib": round(plan.gpu_peak_bytes / 2**30, 2),
        "host_peak_rss_gib": round(rss.peak / 2**30, 2),
        "planned_host_peak_gib": round(plan.host_peak_bytes / 2**30, 2),
        "seq_tile": plan.inputs.seq_tile,  # the blocks' tile (--seq-tile auto: the plan's choice), 0 untiled
        "host_bytes_per_param": round(rss.peak / params, 2),
        "pcie_gbps": {"h2d": round(h2d_gbps, 1), "d2h": round(d2h_gbps, 1)},
        "bound_ms": {k: round(v, 1) for k, v in bounds.items()},
        "binding_limit": binding,
        "physical_bound_tokens_per_s": round(tokens / (max(bounds.values()) / 1e3), 1),
        "median_block_overlap": median_overlap,
        "critical_batch_size": round(cfg.options.batch_size / median_overlap, 1) if median_overlap else None,
        "update_placement": cfg.options.update_placement.value,
        "streamed_units": list(placement.streamed),
        "streamable_units": list(plan.inputs.streamable_units),
        "streamed_units_per_step": streamed_per_step,
        "placement_changes": [change.to_dict() for change in replacement.changes] if replacement is not None else [],
        "measured_against_predicted": measured_against_predicted(plan.resource_s, planned_step_s, bounds, step_s),
        "planned_step_s": {"speculating": plan.step_time_s, "deferred": plan.clipped_step_time_s},
        "measured_against_planned_terms": terms.to_dict() if terms is not None else {},
        "losses": [round(x, 4) for x in losses],
        "attention": attention_summary(model, device.torch_device.type, torch.bfloat16),
        "linear_attention": linear.describe() if linear is not None else None,
        "units": units,
    }
    if cfg.trace_dir is not None:
        result["trace"] = write_trace(spans, cfg.trace_dir)
    return result


_PREDICTED_BOUNDS = {
    "gpu compute": ("gpu compute",),
    "pcie": ("pcie h2d", "pcie d2h", "pcie duplex"),
    "host optimizer": ("cpu", "host memory"),
}
"""Which of the plan's resources (slide_hf/planner/unit_costs.py) each of the benchmark's bounds is: the larger
of them, as the engine runs them concurrently."""


def measured_against_predicted(
    resource_s: dict[str, float], step_time_s: float, bounds_ms: dict[str, float], step_s: float
) -> dict[str, dict[str, float | None]]:
    """The measured step and each measured bound (``bounds_ms``: gpu compute, pcie, host optimizer) beside
    what the plan predicted for it (``resource_s``, ``step_time_s``), with their ratio (measured /
    predicted; None where the plan predicts nothing)."""

    def row(measured_s: float, predicted_s: float) -> dict[str, float | None]:
        ratio = round(measured_s / predicted_s, 2) if predicted_s > 0 else None
        return {"measured_s": round(measured_s, 4), "predicted_s": round(predicted_s, 4), "ratio": ratio}

    rows = {"step": row(step_s, step_time_s)}
    for bound, resources in _PREDICTED_BOUNDS.items():
        if bound in bounds_ms:
            rows[bound] = row(bounds_ms[bound] / 1e3, max(resource_s.get(r, 0.0) for r in resources))
    return rows


def describe_unit(unit: Any, experts_per_token: int | None = None) -> dict[str, Any]:
    """What a unit's timings are compared by: its kind (blocks of one kind run the same code on the same
    shapes: layer type, module class, parameter shapes), its parameter count, and the matmul parameters every
    token multiplies by (``active_matmul_params``): the dense ones (shared experts included, which every token
    passes through) and, of the routed experts' stacked tensors (``...experts.*``, one slice per expert), the
    ``experts_per_token`` slices a token is routed to (the model config's ``num_experts_per_tok``)."""
    root = getattr(unit, "root", None)
    layout = tuple((spec.name, tuple(spec.shape)) for spec in unit.layout)
    attention = getattr(unit, "attention_type", None)
    label = type(root).__name__ if root is not None else type(unit).__name__
    if attention:
        label = f"{label}:{attention}"
    digest = hashlib.sha1(repr(layout).encode()).hexdigest()[:6]
    routed = [spec for spec in unit.layout if _routed_expert(spec.name) and len(spec.shape) >= 3]
    routed_names = {spec.name for spec in routed}
    dense = sum(spec.numel for spec in unit.layout if len(spec.shape) >= 2 and spec.name not in routed_names)
    active = dense + sum(spec.numel // spec.shape[0] * min(experts_per_token or 1, spec.shape[0]) for spec in routed)
    return {
        "kind": f"{label}#{digest}",
        "params": unit.layout.param_numel,
        "dense_matmul_params": dense,
        "active_matmul_params": active,
        "has_experts": bool(routed),
    }


def _routed_expert(name: str) -> bool:
    """A routed experts' stacked tensor (``mlp.experts.gate_up_proj``), not a shared expert
    (``shared_experts.*``, ``shared_expert.*``) nor the router."""
    return "experts" in name.split(".")[:-1]


def _scratch(cfg: BenchConfig) -> Any:
    """Tiers that keep files put them in --nvme-dir itself (each in its own folder, removed at close)."""

    def directory() -> Path:
        if cfg.options.nvme_dir is None:
            raise UserError(f"--offload-optimizer {cfg.options.offload_optimizer} needs --nvme-dir PATH")
        return cfg.options.nvme_dir

    return directory


def run_plain(cfg: BenchConfig, config: Any) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    assert cfg.options.seq_len is not None and cfg.options.steps is not None  # resolved by run_bench; declared
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=_plain_attention(config), dtype=torch.float32
        )
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    batches = _batches(config.vocab_size, cfg.options.batch_size, cfg.options.seq_len, cfg.options.steps)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for micro in batches:
        ids, labels = (t.cuda() for t in micro[0])
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    step_s = statistics.median(times[cfg.warmup :] or times)
    tokens = cfg.options.batch_size * cfg.options.seq_len
    result = {
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "tflops": round(flops_per_token(config, params, cfg.options.seq_len) * tokens / step_s / 1e12, 1),
        "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "losses": [round(x, 4) for x in losses],
    }
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _plain_attention(config: Any) -> str:
    """The attention the engine runs on this GPU in bf16, for HF's reference model, which takes one
    implementation for every layer (the rule gives every layer type the same one today)."""
    from slide_hf import build_model

    model = cast("HFCausalLM", build_model(config))  # every registered adapter is one
    chosen = set(model.attention_for("cuda", torch.bfloat16).values())
    if len(chosen) != 1:
        raise ValueError(f"layer types run different attention ({sorted(chosen)}); HF's model takes one")
    return chosen.pop()


def write_trace(spans: list[Any], directory: Path) -> dict[str, str]:
    """A Chrome trace (chrome://tracing, Perfetto) and a PNG timeline of the traced steps (the last two), five
    tracks: the device's three streams, the host optimizer, and the main thread's waits for parameters."""
    directory.mkdir(parents=True, exist_ok=True)
    tracks = ["GPU compute", "h2d", "d2h", "CPU update", "main thread waits"]
    events = [
        {
            "name": span.unit,
            "cat": span.phase,
            "ph": "X",
            "ts": round(span.start_ms * 1e3, 1),
            "dur": round(span.duration_ms * 1e3, 1),
            "pid": 0,
            "tid": tracks.index(span.track) if span.track in tracks else 0,
        }
        for span in spans
    ]
    meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": t}} for i, t in enumerate(tracks)]
    trace_path = directory / "trace.json"
    trace_path.write_text(json.dumps({"traceEvents": meta + events}))
    out = {"chrome_trace": str(trace_path)}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        out["png"] = "matplotlib not installed"
        return out
    colors = {
        "forward": "#4c72b0", "backward": "#dd8452", "head": "#c44e52", "h2d": "#55a868", "d2h": "#8172b3",
        "wait": "#8c8c8c",
    }  # fmt: skip
    figure, axis = plt.subplots(figsize=(16, 3.2))
    for span in spans:
        row = len(tracks) - 1 - (tracks.index(span.track) if span.track in tracks else 0)
        color = colors.get(span.phase, "#937860")
        axis.broken_barh([(span.start_ms, max(span.duration_ms, 0.05))], (row - 0.4, 0.8), color=color)
    axis.set_yticks(range(len(tracks)), list(reversed(tracks)))
    axis.set_xlabel("ms from the first traced step's start")
    axis.set_title(
        "the last two training steps: forward (blue), backward (orange), head (red), h2d (green), d2h (purple),"
        " update, waits (grey)"
    )
    figure.tight_layout()
    png = directory / "timeline.png"
    figure.savefig(png, dpi=110)
    plt.close(figure)
    out["png"] = str(png)
    return out


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    from slide_hf.launch import host_cores_for_this_run

    with host_cores_for_this_run():  # as `slide train`, before numba is imported (Note [Host cores per rank])
        return _run_bench(cfg)


def _run_bench(cfg: BenchConfig) -> dict[str, Any]:
    from slide_hf import resolve_model

    config, _ = resolve_model(cfg.options.model)
    seq_len = resolve_seq_len(cfg.options.seq_len, config)
    cfg = dataclasses.replace(cfg, options=dataclasses.replace(cfg.options, seq_len=seq_len))
    total_layers = config.num_hidden_layers
    if cfg.layers is not None:
        from slide_hf.truncate import truncate_layers

        config = truncate_layers(config, cfg.layers)
    gpu_memory = cfg.run_options().gpu_memory_bytes
    result: dict[str, Any] = {
        "model": cfg.options.model,
        "layers": {"run": config.num_hidden_layers, "of": total_layers},
        "batch_size": cfg.options.batch_size,
        "seq_len": cfg.options.seq_len,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "gpu_memory_gib": None if gpu_memory is None else gpu_memory / 2**30,
        "slide": run_engine(cfg, config),
    }
    if cfg.compare_plain:
        result["plain"] = run_plain(cfg, config)
        result["ratio"] = round(result["slide"]["tokens_per_s"] / result["plain"]["tokens_per_s"], 3)
    return result
