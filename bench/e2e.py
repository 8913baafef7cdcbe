"""End-to-end training throughput: the sliding engine vs plain PyTorch, in one invocation.

    python bench/e2e.py --model llama3.2-3b --batch-size 16 --seq-len 1024 --steps 6 --compare plain

Reports tok/s, TFLOPS (6N + 12·L·H·S per token; the engine's recompute is not counted), GPU peak, host
peak RSS, the per-unit hiding factor eta = T_bwd / (T_d2h + T_update) and which limit binds. Inputs are
random token ids (never zeros). The plain reference is the HF model entirely on the GPU with fp32
weights, bf16 autocast, gradient checkpointing, SDPA and fused GPU AdamW.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time
from pathlib import Path

import psutil
import torch


class PeakRss:
    """Samples this process's RSS every 50 ms on a thread of its own (a context manager)."""

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


def _batches(vocab: int, batch: int, seq: int, count: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [
        [(ids, ids.clone())]
        for ids in (torch.randint(1, vocab, (batch, seq), generator=generator) for _ in range(count))
    ]


def run_engine(args, config) -> dict:
    from slide_core import AdamWConfig, HostParameters
    from slide_core.devices.cuda import CUDADevice
    from slide_core.engine import Engine, EngineConfig
    from slide_core.optim import TorchAdamW
    from slide_hf import build_model, init_random

    model = build_model(config)
    params = sum(u.layout.param_numel for u in model.units)
    limit = int(float(args.gpu_memory) * 2**30) if args.gpu_memory else None
    batches = _batches(config.vocab_size, args.batch_size, args.seq_len, args.steps)
    times, losses = [], []
    if torch.cuda.is_available():
        device = CUDADevice(memory_limit_bytes=limit)
    else:  # a smoke test of this script on a machine without a GPU
        from slide_core.devices.cpu import CPUDevice

        device = CPUDevice()
    with PeakRss() as rss, device:
        began = time.perf_counter()
        host = HostParameters(model, device.alloc_pinned)
        init_random(model, host, config, seed=0)
        setup_s = time.perf_counter() - began
        from slide_core.engine.placement import choose_resident_units

        resident = choose_resident_units(model, int(args.resident_gib * 2**30), torch.bfloat16, accumulates=False)
        engine_config = EngineConfig(
            block_slots=args.block_slots, compute_dtype=torch.bfloat16, resident_units=resident
        )
        with Engine(model, device, host, TorchAdamW(AdamWConfig()), engine_config) as engine:
            device.reset_peak_memory()
            unit_times = {}
            for index, micro in enumerate(batches):
                device.synchronize()
                start = time.perf_counter()
                result = engine.step(micro, lr=1e-5)
                times.append(time.perf_counter() - start)
                losses.append(result.loss)
                if index == len(batches) - 1:
                    engine.drain()
                taken = engine.unit_times()
                if index >= args.warmup:
                    for name, t in taken.items():
                        unit_times.setdefault(name, []).append(dict(t.ms))
            gpu_peak = device.peak_memory_bytes()
    steady = times[args.warmup :]
    step_s = statistics.median(steady)
    tokens = args.batch_size * args.seq_len
    etas = {}
    for name, records in unit_times.items():
        bwd = statistics.mean(r.get("backward", 0.0) + r.get("head", 0.0) for r in records)
        cost = statistics.mean(r.get("d2h", 0.0) + r.get("update", 0.0) for r in records)
        phases = {k: round(statistics.mean(r.get(k, 0.0) for r in records), 2) for k in records[0]}
        etas[name] = {"eta": round(bwd / cost, 3) if cost else None, **phases}
    flops = _flops_per_token(config, params, args.seq_len)
    return {
        "params": params,
        "resident_units": list(resident),
        "setup_s": round(setup_s, 1),
        "step_s": round(step_s, 4),
        "step_times_s": [round(t, 4) for t in times],
        "tokens_per_s": round(tokens / step_s, 1),
        "tflops": round(flops * tokens / step_s / 1e12, 1),
        "gpu_peak_gib": round(gpu_peak / 2**30, 2),
        "host_peak_rss_gib": round(rss.peak / 2**30, 2),
        "host_bytes_per_param": round(rss.peak / params, 2),
        "losses": [round(x, 4) for x in losses],
        "units": etas,
    }


def run_plain(args, config) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    batches = _batches(config.vocab_size, args.batch_size, args.seq_len, args.steps)
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
    step_s = statistics.median(times[args.warmup :])
    tokens = args.batch_size * args.seq_len
    result = {
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "tflops": round(_flops_per_token(config, params, args.seq_len) * tokens / step_s / 1e12, 1),
        "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "losses": [round(x, 4) for x in losses],
    }
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _flops_per_token(config, params: int, seq_len: int) -> float:
    return 6.0 * params + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3.2-3b")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gpu-memory", help="GiB cap for the engine's device")
    parser.add_argument("--block-slots", type=int, default=2)
    parser.add_argument(
        "--resident-gib",
        type=float,
        default=0.0,
        help="GPU memory (GiB) to spend on device-resident units (master + Adam state on the GPU)",
    )
    parser.add_argument("--compare", choices=("plain",), help="also run the plain PyTorch reference")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()

    from slide_hf import resolve_model

    config, _ = resolve_model(args.model)
    config._attn_implementation = "sdpa"
    result = {
        "model": args.model,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "slide": run_engine(args, config),
    }
    if args.compare == "plain":
        result["plain"] = run_plain(args, config)
        result["ratio"] = round(result["slide"]["tokens_per_s"] / result["plain"]["tokens_per_s"], 3)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
