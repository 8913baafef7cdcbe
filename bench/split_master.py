"""The split master's two costs and its one gain, measured: the host AdamW step over an fp32 master vs a
split one (FusedAdamW's in-register decode and encode, both 26 B/param), and the host-to-device copy of
one streamed unit from each (fp32 cast on the device vs the bf16 plane as it is).

Every time is the median of ``--reps``, the two formats interleaved rep by rep on the same moments and
gradient. The copy needs a CUDA device and is skipped without one.

    python bench/split_master.py --numel 218000000 --threads 16 --reps 7 --json split_master.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from slide_core.optim.adamw_config import AdamWConfig
from slide_core.optim.fused_adamw import FusedAdamW
from slide_core.split_master import SplitMaster, tie_bytes


def _adam(numel: int, threads: int | None, reps: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=generator) * 0.02
    split = SplitMaster(
        torch.empty(numel, dtype=torch.bfloat16),
        torch.empty(numel, dtype=torch.int16),
        torch.zeros(tie_bytes(numel), dtype=torch.uint8),
    )
    split.encode_(master)
    state = {"exp_avg": torch.zeros(numel), "exp_avg_sq": torch.zeros(numel)}
    grad = (torch.randn(numel, generator=generator) * 1e-3).to(torch.bfloat16)
    optimizer = FusedAdamW(AdamWConfig(weight_decay=0.1), threads=threads)
    optimizer.warmup()
    times: dict[str, list[float]] = {"fp32": [], "split": []}
    for rep in range(reps + 1):
        for name, target in (("fp32", master), ("split", split)):
            began = time.perf_counter()
            optimizer.step(target, grad, state, lr=1e-4, step=rep + 1, decay=True)
            if rep:  # the first round warms the pages
                times[name].append(time.perf_counter() - began)
    out = {}
    for name, samples in times.items():
        seconds = statistics.median(samples)
        out[f"adam_{name}_ms"] = round(seconds * 1e3, 2)
        out[f"adam_{name}_gparams"] = round(numel / seconds / 1e9, 3)
        out[f"adam_{name}_gbps_at_26b"] = round(26 * numel / seconds / 1e9, 1)
    return out


def _h2d(numel: int, reps: int) -> dict[str, float]:
    if not torch.cuda.is_available():
        return {}
    fp32 = torch.randn(numel).pin_memory()
    bf16 = fp32.to(torch.bfloat16).pin_memory()
    slot = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    times: dict[str, list[float]] = {"fp32": [], "split": []}
    for rep in range(reps + 1):
        for name, source in (("fp32", fp32), ("split", bf16)):
            torch.cuda.synchronize()
            began = time.perf_counter()
            slot.copy_(source, non_blocking=True)
            torch.cuda.synchronize()
            if rep:
                times[name].append(time.perf_counter() - began)
    out = {}
    for name, samples in times.items():
        seconds = statistics.median(samples)
        out[f"h2d_{name}_ms"] = round(seconds * 1e3, 2)
        out[f"h2d_{name}_gparams"] = round(numel / seconds / 1e9, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 * 1024 * 1024, help="parameters per step (default 64M)")
    parser.add_argument("--h2d-numel", type=int, default=200 * 1024 * 1024, help="parameters per copy (one unit)")
    parser.add_argument("--threads", type=int, default=None, help="numba threads (default: every core)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = {"numel": args.numel, **_adam(args.numel, args.threads, args.reps), **_h2d(args.h2d_numel, args.reps)}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
