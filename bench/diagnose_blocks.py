"""Why is a model's streamed block slower than its resident twin? One short run that says, per block unit,
where it lives, what dtypes its parameters and input arrive in, whether its host range is pinned, and which
GPU kernels one step spends its time in (torch.profiler).

    python bench/diagnose_blocks.py --model gemma3-12b --layers 6 --gpu-memory 24 --batch-size 16 --seq-len 1024

Set up as `slide bench` sets up its engine (slide_hf/bench.py); random token ids, never zeros.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from slide_hf.bench import BenchConfig, _batches, _scratch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--gpu-memory", type=float, default=24)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--switch-interval", type=float, help="sys.setswitchinterval for the run (Python's default 0.005 s)"
    )
    parser.add_argument(
        "--no-sync",
        action="store_true",
        help="time each block's forward without synchronizing around it: host issue time, main-thread CPU "
        "time and the device span between two events, plus where a sampler finds the main thread",
    )
    parser.add_argument(
        "--pinned-slab", action="store_true", help="allocate the master slab page-locked (device.alloc_pinned)"
    )
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    from slide_core import AdamWConfig, HostParameters
    from slide_core.engine import choose_master_format
    from slide_hf import build_model, init_random, resolve_model
    from slide_hf.options import TrainConfig
    from slide_hf.setup import make_device, make_optimizer, open_engine, place_units
    from slide_hf.truncate import truncate_layers

    config, _ = resolve_model(args.model)
    if args.layers:
        config = truncate_layers(config, args.layers)
    run = {"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "gpu_memory": args.gpu_memory}
    cfg = BenchConfig(TrainConfig.for_command("bench", **run))
    options = cfg.run_options()
    model = build_model(config)
    device = make_device(options.device, options.gpu_memory_bytes)
    placement = place_units(model, device, options)
    seen: dict[str, dict[str, Any]] = defaultdict(dict)
    sync = torch.cuda.synchronize if torch.cuda.is_available() and not args.no_sync else (lambda: None)
    sampler = MainThreadSampler()
    spans: list[tuple[str, Any, Any]] = []
    activity = (
        torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else torch.profiler.ProfilerActivity.CPU
    )
    for unit in model.blocks:
        original = unit.forward

        def traced(params: Any, x: torch.Tensor, inputs: Any, _unit: Any = unit, _forward: Any = original) -> Any:
            record = seen[_unit.name]
            record["param dtypes"] = sorted({str(p.dtype) for p in params.values()})
            record["input"] = f"{x.dtype} {tuple(x.shape)} contiguous={x.is_contiguous()}"
            sync()
            began, cpu_began = time.perf_counter(), time.thread_time()
            start = _event()
            sampler.unit = _unit.name
            out = _forward(params, x, inputs)
            sampler.unit = None
            end = _event()
            sync()
            label = "forward ms (synchronized)" if not args.no_sync else "forward issue ms"
            record.setdefault(label, []).append(round((time.perf_counter() - began) * 1e3, 1))
            if args.no_sync:
                record.setdefault("main-thread CPU ms", []).append(round((time.thread_time() - cpu_began) * 1e3, 1))
                spans.append((_unit.name, start, end))
            return out

        unit.forward = traced  # type: ignore[method-assign]
    with device:
        optimizer = make_optimizer(options.optimizer, AdamWConfig(state_format=options.optimizer_state))
        master_format = choose_master_format(options.master, options.compute_dtype, optimizer)
        alloc = {"alloc": device.alloc_pinned} if args.pinned_slab else {}
        host = HostParameters(model, master_format=master_format, **alloc)
        init_random(model, host, config, seed=0)
        batches = _batches(config.vocab_size, options.batch_size, options.seq_len, args.steps)
        with open_engine(model, device, host, optimizer, options, placement, scratch=_scratch(cfg)) as engine:
            for unit in model.units:
                if unit.name not in placement.resident:
                    source = host.h2d_source(unit)
                    middle = source[source.numel() // 2 :]
                    print(
                        f"{unit.name}: host range {source.numel() * source.element_size() / 2**30:.2f} GiB, "
                        f"first byte pinned {source.is_pinned()}, middle {middle.is_pinned()}, "
                        f"last byte pinned {source[-1:].is_pinned()}; {_copy_rate(source)}"
                    )
            for micro in batches[:-1]:
                engine.step(micro, lr=1e-5)
            times = engine.unit_times()
            for unit in model.units:
                if unit.name not in placement.resident:
                    source = host.h2d_source(unit)
                    print(f"{unit.name} after {len(batches) - 1} steps: {_copy_rate(source)}")
            retries_before = _allocator_counts()
            with sampler, torch.profiler.profile(activities=[activity]) as profile:
                engine.step(batches[-1], lr=1e-5)
                engine.wait_idle()
            print(f"allocator during the profiled step: {_allocator_counts(retries_before)}")
            engine.close(keep_host_state=False)
    for unit in model.blocks:
        where = "resident" if unit.name in placement.resident else "streamed"
        phases = {k: round(v, 1) for k, v in times[unit.name].ms.items()} if unit.name in times else {}
        print(f"{unit.name} ({where}, {getattr(unit, 'attention_type', '')}): {dict(seen[unit.name])} phases {phases}")
    if spans and torch.cuda.is_available():
        torch.cuda.synchronize()
        device_ms: dict[str, list[float]] = defaultdict(list)
        for name, start, end in spans:
            device_ms[name].append(round(start.elapsed_time(end), 1))
        for name, values in device_ms.items():
            print(f"{name}: device span between forward start and end events (ms): {values}")
    sampler.report()
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    profile.export_chrome_trace(str(trace))
    copies: dict[str, list[int]] = defaultdict(list)
    for event in json.loads(trace.read_text())["traceEvents"]:
        if event.get("cat") == "gpu_memcpy":
            copies[event["name"]].append(int(event.get("args", {}).get("bytes", 0)))
    for name, sizes in copies.items():
        print(f"{name}: {len(sizes)} copies, {sum(sizes) / 2**30:.2f} GiB, largest {max(sizes) / 2**20:.1f} MiB")
    print(
        profile.key_averages().table(
            sort_by="cuda_time_total" if torch.cuda.is_available() else "cpu_time_total",
            row_limit=25,
            max_name_column_width=90,
        )
    )


def _copy_rate(source: torch.Tensor) -> str:
    """GB/s of one chunk's host-to-device copy from the start of ``source`` on a side stream (pinned memory
    moves at PCIe speed, about 50 GB/s; pageable memory at a fraction of it)."""
    if not torch.cuda.is_available():
        return "no device"
    chunk = source[: min(source.numel(), 2**24)]
    target = torch.empty(chunk.shape, dtype=chunk.dtype, device="cuda")
    stream = torch.cuda.Stream()
    rates = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            target.copy_(chunk, non_blocking=True)
            end.record()
        end.synchronize()
        rates.append(chunk.numel() * chunk.element_size() / start.elapsed_time(end) / 1e6)
    return (
        f"chunk copy {chunk.numel() * chunk.element_size() / 2**20:.0f} MiB at "
        + ", ".join(f"{rate:.1f}" for rate in rates)
        + " GB/s"
    )


def _event() -> Any:
    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _allocator_counts(before: dict[str, int] | None = None) -> dict[str, int]:
    """The caching allocator's retries (a cap reached: every cached block freed, with a device sync) and
    its cudaMalloc/cudaFree calls; with ``before``, the change since then."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    now = {key: int(stats.get(key, 0)) for key in keys}
    return now if before is None else {key: now[key] - before[key] for key in keys}


class MainThreadSampler:
    """Samples the main thread's innermost frames every millisecond while a block's forward is being issued
    (``unit`` set): if it is found outside torch's own calls, something else holds it (the GIL, a lock)."""

    def __init__(self) -> None:
        self.unit: str | None = None
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MainThreadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            unit = self.unit
            if unit is None:
                continue
            frame = sys._current_frames().get(self._main)
            where = []
            while frame is not None and len(where) < 3:
                where.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}:{frame.f_code.co_name}")
                frame = frame.f_back
            self.counts[unit][" < ".join(where)] += 1

    def report(self) -> None:
        for unit, counts in self.counts.items():
            top = sorted(counts.items(), key=lambda item: -item[1])[:6]
            total = sum(counts.values())
            print(f"{unit}: {total} samples of the main thread; top: {top}")


if __name__ == "__main__":
    main()
