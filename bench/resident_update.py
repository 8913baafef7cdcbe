"""A device-resident unit's optimizer update on the GPU: its peak memory against what the optimizer reports.

Runs the device replica of each AdamW (compact bf16/int8 moments, and fp32 with ``torch._fused_adamw_``)
over one range the size of a unit (default: Llama-3.2-3B's embedding, 128256 x 3072) with bf16 gradients,
as the engine updates a resident unit: the first step and a clipping correction from fresh, then timed
steps. It prints, per optimizer, the growth of ``torch.cuda.max_memory_allocated`` beside
``device_scratch_bytes`` (what the planner adds to the GPU peak; the CPU tests count the same allocations
op by op), and the median step time. ``--chunk-numel`` changes the chunk (0: one pass over the whole range,
the unchunked path's memory, for comparison).

    python bench/resident_update.py --numel 394002432 --json resident_update.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from slide_core import AdamWConfig
from slide_core.optim import TorchAdamW
from slide_core.optim.adamw import CHUNK_NUMEL
from slide_core.optim.compact_adamw import CompactAdamW
from slide_core.optimizer import Correction, Optimizer


def _replica(state_format: str, chunk_numel: int) -> Optimizer:
    config = AdamWConfig(state_format=state_format, weight_decay=0.1)
    if state_format == "fp32":
        return TorchAdamW(config, chunk_numel=chunk_numel).device_replica()
    return CompactAdamW(config, fused=False, chunk_numel=chunk_numel).device_replica()


def measure(state_format: str, numel: int, chunk_numel: int, steps: int) -> dict[str, object]:
    """Peak growth of one fresh replica's step, and of its step plus a correction, and the step time."""
    optimizer = _replica(state_format, chunk_numel)
    master = torch.randn(numel, device="cuda") * 0.02
    grad = (torch.randn(numel, device="cuda") * 1e-3).bfloat16()
    state = {a.name: torch.zeros(a.numel(numel), dtype=a.dtype, device="cuda") for a in optimizer.state_arrays}
    torch.cuda.synchronize()  # note: a CPU-GPU sync point (here and below: measuring)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result: dict[str, object] = {"state": state_format, "numel": numel, "chunk_numel": chunk_numel}
    try:
        optimizer.step(master, grad, state, lr=1e-3, step=1, decay=True)
        torch.cuda.synchronize()
        result["step_peak_bytes"] = torch.cuda.max_memory_allocated() - base
        coeff = torch.tensor(0.5, device="cuda")
        correction = Correction("rescale", 0.3)
        optimizer.correct(master, grad, state, applied=coeff, correction=correction, lr=1e-3, step=1, decay=True)
        torch.cuda.synchronize()
        result["corrected_peak_bytes"] = torch.cuda.max_memory_allocated() - base
        times = []
        for step in range(2, 2 + steps):
            start = time.perf_counter()
            optimizer.step(master, grad, state, lr=1e-3, step=step, decay=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        result["step_ms"] = 1e3 * statistics.median(times)
    except torch.OutOfMemoryError as error:
        result["error"] = str(error).splitlines()[0]
    result["reported_bytes"] = optimizer.device_scratch_bytes(numel)
    result["reported_corrects_bytes"] = optimizer.device_scratch_bytes(numel, corrects=True)
    del master, grad, state, optimizer
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=128256 * 3072, help="elements of the unit's range")
    parser.add_argument("--chunk-numel", type=int, default=CHUNK_NUMEL, help="0: one pass over the range")
    parser.add_argument("--states", default="bf16,int8,fp32", help="comma-separated state formats")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    chunk = args.chunk_numel or 64 * (args.numel // 64 + 1)
    results = [measure(fmt, args.numel, chunk, args.steps) for fmt in args.states.split(",")]
    for r in results:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
