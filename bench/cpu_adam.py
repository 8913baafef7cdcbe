"""Host AdamW step throughput: torch (bf16->fp32 cast + ``torch._fused_adamw_``) vs slide-core's FusedAdamW.

Both optimizers update the SAME fp32 master / exp_avg / exp_avg_sq buffers from the SAME bf16 gradient
(random data), one ``--numel`` range per step, interleaved rep by rep; each time is the median of
``--reps``. A STREAM-like triad ``a = b + s*c`` (torch, multi-threaded) over fp32 arrays with the fused
step's footprint measures the memory bandwidth the step is bounded by.

Bytes per parameter, counted the STREAM way (what the code reads and writes; the triad counts 12 B/elt):

* fused: bf16 grad 2 + master, exp_avg, exp_avg_sq read+write 3x8 = 26.
* torch + cast: cast 2 + 4 (+4 of write-allocate on the scratch), then fp32 grad 4 + 3x8 = 38 (34 without
  the write-allocate; "~40" in the design notes).

* compact state (``--optimizer-state``, ``CompactAdamW``'s numba kernels): bf16 grad 2 + master 8 + the two
  moments read+write in their format: bf16 2 x 4 = 18; int8 2 x (2 + 2 x 4/64) = 14.25 (codes and block scales).
  They do the fp32 step plus a hash and a stochastic rounding per element, so they are bound by bandwidth
  only if the cores keep up: the table says what fraction of the triad they reach.

Effective GB/s = Gparam/s x bytes/param; "% triad" compares that to the triad's GB/s.

    python bench/cpu_adam.py --numel 218000000 --threads 16 --reps 7 --json cpu_adam.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

try:
    import slide_core  # noqa: F401
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "slide-core" / "src"))

from slide_core import AdamWConfig
from slide_core.optim import TorchAdamW
from slide_core.optim.compact_adamw import CompactAdamW, compact_bytes_per_param
from slide_core.optim.fused_adamw import FusedAdamW
from slide_core.optim.state_formats import encode_moments, state_arrays, stream_key

FUSED_BYTES = 26
TORCH_CAST_BYTES = 38
CAST_BYTES = 10  # bf16 read 2, fp32 write 4, write-allocate 4
TORCH_ADAM_BYTES = 28  # fp32 grad read 4, master / exp_avg / exp_avg_sq read+write
TRIAD_BYTES = 12  # per element: read b, read c, write a (STREAM convention, no write-allocate)


def _median_time(fn: Callable[[], None]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=218_000_000, help="range size (default: one Llama-3.1-8B layer)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (after compile)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch and numba threads")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument(
        "--state-formats",
        default="bf16,int8",
        help="compact optimizer-state formats to time as well, comma-separated (default bf16,int8; '' for none)",
    )
    p.add_argument("--json", type=Path, default=None, help="write results here")
    args = p.parse_args()
    if not FusedAdamW.available():
        sys.exit("numba is not importable: pip install numba")

    torch.set_num_threads(args.threads)
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen).mul_(0.02)
    exp_avg = torch.randn(n, generator=gen).mul_(1e-3)
    exp_avg_sq = torch.rand(n, generator=gen).mul_(1e-6).add_(1e-12)
    grad = torch.randn(n, generator=gen).mul_(1e-2).to(torch.bfloat16)
    state = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    triad_n = -(-FUSED_BYTES * n // TRIAD_BYTES)  # three fp32 arrays with the fused step's footprint
    ta, tb, tc = (torch.rand(triad_n, generator=gen) for _ in range(3))

    config = AdamWConfig(weight_decay=args.weight_decay)
    torch_opt = TorchAdamW(config, fused=None)
    torch_opt.reserve(n)
    fused_opt = FusedAdamW(config, threads=args.threads)
    began = time.perf_counter()
    fused_opt.warmup()
    compile_s = time.perf_counter() - began
    scratch = torch.empty(n)  # the breakdown's own fp32 gradient, not TorchAdamW's private scratch
    step_t = torch.ones((), dtype=torch.float32)
    count = [0]

    def torch_step() -> None:
        count[0] += 1
        torch_opt.step(master, grad, state, lr=1e-4, step=count[0], decay=True)

    def fused_step() -> None:
        count[0] += 1
        fused_opt.step(master, grad, state, lr=1e-4, step=count[0], decay=True)

    def cast_only() -> None:
        scratch.copy_(grad)

    def adam_only() -> None:  # on the fp32 gradient the cast above left in the scratch
        count[0] += 1
        step_t.fill_(float(count[0]))
        torch._fused_adamw_(
            [master], [scratch], [exp_avg], [exp_avg_sq], [], [step_t], lr=1e-4, beta1=config.beta1,
            beta2=config.beta2, weight_decay=args.weight_decay, eps=config.eps, amsgrad=False, maximize=False,
        )  # fmt: skip

    def triad() -> None:
        torch.add(tb, tc, alpha=1.5, out=ta)

    cases = {
        "torch_cast": torch_step,
        "fused": fused_step,
        "cast_only": cast_only,
        "adam_only": adam_only,
        "triad": triad,
    }
    formats = [f for f in args.state_formats.split(",") if f]
    for state_format in formats:
        cases[f"compact_{state_format}"] = _compact_step(state_format, args, master, grad, exp_avg, exp_avg_sq, count)
    for _ in range(args.warmup):
        for fn in cases.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.reps):
        for name, fn in cases.items():
            times[name].append(_median_time(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    triad_gbs = TRIAD_BYTES * triad_n / med["triad"] / 1e9

    rows = []
    for name, label, nbytes in (
        ("torch_cast", "(a) torch: bf16->fp32 cast + _fused_adamw_", TORCH_CAST_BYTES),
        ("cast_only", "    (a1) cast alone", CAST_BYTES),
        ("adam_only", "    (a2) _fused_adamw_ alone", TORCH_ADAM_BYTES),
        ("fused", "(b) FusedAdamW (numba, bf16 grad)", FUSED_BYTES),
        *(
            (f"compact_{f}", f"(d) CompactAdamW, {f} state (numba, bf16 grad)", compact_bytes_per_param(f))
            for f in formats
        ),
    ):
        gparams = n / med[name] / 1e9
        gbs = gparams * nbytes
        rows.append(
            {
                "case": name,
                "label": label,
                "ms": med[name] * 1e3,
                "gparam_s": gparams,
                "bytes_per_param": nbytes,
                "gb_s": gbs,
                "pct_triad": 100 * gbs / triad_gbs,
            }
        )
    speedup = med["torch_cast"] / med["fused"]
    meta = {
        "numel": n,
        "threads": args.threads,
        "reps": args.reps,
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_adamw_fused": torch_opt.fused,
        "numba_compile_or_cache_load_s": compile_s,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "triad_numel": triad_n,
        "triad_ms": med["triad"] * 1e3,
        "triad_gb_s": triad_gbs,
        "speedup_fused_vs_torch_cast": speedup,
    }

    print(
        f"numel {n:,}  threads {args.threads}  reps {args.reps} (median)  torch {torch.__version__} "
        f"({meta['torch_cpu_capability']})  numba compile/cache-load {compile_s:.1f} s\n"
    )
    print("| step | ms | Gparam/s | B/param | GB/s | % triad |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['label']} | {r['ms']:.1f} | {r['gparam_s']:.3f} | {r['bytes_per_param']:g} | "
            f"{r['gb_s']:.1f} | {r['pct_triad']:.0f}% |"
        )
    print(
        f"| (c) triad a = b + s*c ({triad_n:,} fp32 x 3) | {med['triad'] * 1e3:.1f} | | 12/elt | {triad_gbs:.1f} | 100% |"
    )
    print(
        f"\nspeedup fused vs torch+cast: {speedup:.2f}x  (the bytes ratio {TORCH_CAST_BYTES}/{FUSED_BYTES} "
        f"= {TORCH_CAST_BYTES / FUSED_BYTES:.2f}x is the bandwidth-bound ceiling)\n"
        f"triad counted with write-allocate (16 B/elt, what the DRAM really moves): {triad_gbs * 16 / 12:.1f} GB/s"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))


def _compact_step(
    state_format: str,
    args: argparse.Namespace,
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    count: list[int],
) -> Callable[[], None]:
    """A step of ``CompactAdamW``'s kernel over the same master and gradient, on its own compact copy of
    the moments (encoded from the fp32 ones, so the values it works on are the same)."""
    n = master.numel()
    state = {a.name: torch.empty(a.numel(n), dtype=a.dtype) for a in state_arrays(state_format)}
    encode_moments(state_format, exp_avg, exp_avg_sq, state, index0=0, key=stream_key(0, 0))
    optimizer = CompactAdamW(
        AdamWConfig(weight_decay=args.weight_decay, state_format=state_format), threads=args.threads, fused=True
    )
    optimizer.warmup()

    def step() -> None:
        count[0] += 1
        optimizer.step(master, grad, state, lr=1e-4, step=count[0], decay=True)

    return step


if __name__ == "__main__":
    main()
