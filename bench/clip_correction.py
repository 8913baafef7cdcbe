"""Clipping's correction pass on the host: torch ops vs the fused numba pass, on the same buffers.

When the global gradient norm exceeds ``--max-grad-norm``, every speculative AdamW update of the step is
taken back and redone with the clipped gradient (slide_core/engine/clipping.py). This times that pass for
one ``--numel`` range with a bf16 gradient, median of ``--reps``, random data.

    python bench/clip_correction.py --numel 16000000 --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from slide_core import AdamWConfig
from slide_core.engine.clipping import AdamWCorrection, Correction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=16_000_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = AdamWConfig(weight_decay=0.1)
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(args.numel, generator=generator).bfloat16()
    master = torch.randn(args.numel, generator=generator)
    state = {
        "exp_avg": torch.randn(args.numel, generator=generator) * 1e-3,
        "exp_avg_sq": torch.rand(args.numel, generator=generator) * 1e-4,
    }
    results = {}
    for name, fused in (("torch ops", False), ("fused numba", True)):
        correction = AdamWCorrection(config, args.numel, use_fused=fused)
        times = []
        for rep in range(args.reps + 1):
            began = time.perf_counter()
            correction.apply(Correction("rescale", 0.5), master, grad, 1.0, state, lr=1e-5, step=3, decay=True)
            if rep:  # the first call compiles or allocates
                times.append(time.perf_counter() - began)
        results[name] = statistics.median(times) * 1e3
    print(f"| correction of {args.numel:,} params (bf16 grads), {torch.get_num_threads()} threads | ms | Gparam/s |")
    print("|---|---:|---:|")
    for name, ms in results.items():
        print(f"| {name} | {ms:.1f} | {args.numel / ms / 1e6:.2f} |")
    print(f"speedup {results['torch ops'] / results['fused numba']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"numel": args.numel, "ms": results}))


if __name__ == "__main__":
    main()
