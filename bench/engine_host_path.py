"""The host optimizer thread's work per step, per unit, on the CPU device: what the engine adds around the
optimizer's own kernel (accumulation, norms, views, bookkeeping), measured the way `slide bench` reports
'host optimizer' (the summed 'update' spans of host-updated units).

Why the CPU device: it runs the engine's exact schedule and host-side code with synchronous compute, so a
model with little compute (short rows) and many parameters makes the optimizer thread's work the bulk of a
step, and a change to that path shows without a GPU. Run it once per source tree (PYTHONPATH pointing at
that tree's packages/*/src) and compare the JSON files:

    for tree in old new; do
        PYTHONPATH=$(ls -d /tmp/$tree/packages/*/src | paste -sd:) \\
            python bench/engine_host_path.py --tied --json /tmp/$tree.json
    done
    python bench/engine_host_path.py --compare /tmp/old.json /tmp/new.json

The model is slide_core.testing's toy decoder scaled to Llama-like sizes (default: hidden 2048, 4 blocks
of 40M parameters, a 32000-token vocabulary: about 230M parameters tied); the optimizer is ``best_adamw`` (FusedAdamW
with numba). Each run reports, per unit, the median over steps of its 'update' time, and the medians of
the summed host update and of the step's wall time. Run each tree several times, interleaved, on a shared
machine and compare the medians.

``--count-calls`` also records, per engine thread (the optimizer, d2h and h2d workers, and the main
thread), how many times each C-level callable ran during the timed steps: every torch op, lock and numba
kernel launch. Two trees whose torch-op and kernel counts match do the same work on every thread,
whatever the clocks say (lock and queue counts vary with timing); ``--compare`` prints the counts that
differ. Repeated runs of a tree share a label in ``--compare``: the file name up to its first '.'.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch


class _CallCounter:
    """Counts C-level calls per thread while ``active`` (a profile hook on every thread)."""

    def __init__(self) -> None:
        self.active = False
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def __call__(self, frame: object, event: str, arg: object) -> None:
        if self.active and event == "c_call":
            name = getattr(arg, "__qualname__", None) or type(arg).__name__
            self.counts[threading.current_thread().name][name] += 1

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """On this thread and on every thread started inside (the engine's workers)."""
        threading.setprofile(self)
        sys.setprofile(self)
        try:
            yield
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]


def _run(args: argparse.Namespace) -> dict:
    from slide_core.devices.cpu import CPUDevice
    from slide_core.engine import Engine, EngineConfig
    from slide_core.host_params import HostParameters
    from slide_core.optim.adamw_config import AdamWConfig
    from slide_core.optim.fused_adamw import best_adamw
    from slide_core.testing import ToyConfig, ToyModel

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    cfg = ToyConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_heads=args.heads,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        tie_embeddings=args.tied,
    )
    model = ToyModel(cfg)
    host = HostParameters(model)
    generator = torch.Generator().manual_seed(0)
    for unit in model.units:
        flat = host.flat(unit)
        flat.normal_(0.0, 0.02, generator=generator)
    optimizer = best_adamw(AdamWConfig(weight_decay=0.1))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    config = EngineConfig(
        compute_dtype=dtype,
        transfer_chunk_numel=args.chunk_numel,
        resident_units=tuple(args.resident),
        max_grad_norm=args.max_grad_norm,
        report_grad_norm=not args.no_grad_norm,
    )
    batches = []
    for _ in range(args.warmup + args.steps):
        micro = []
        for _ in range(args.accum):
            ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=generator)
            micro.append((ids, ids.clone()))
        batches.append(micro)
    per_unit: dict[str, list[float]] = {unit.name: [] for unit in model.units if unit.name not in args.resident}
    host_ms, wall_ms = [], []
    counter = _CallCounter()
    hooks = counter.installed() if args.count_calls else contextlib.nullcontext()
    with hooks, CPUDevice() as device, Engine(model, device, host, optimizer, config) as engine:
        for number, micro in enumerate(batches):
            engine.wait_idle()  # each step starts from an empty pipeline, so its updates are its own
            engine.unit_times()
            counter.active = number >= args.warmup
            began = time.perf_counter()
            engine.step(micro, lr=1e-4)
            engine.wait_idle()
            elapsed = (time.perf_counter() - began) * 1e3
            counter.active = False
            times = engine.unit_times()
            if number < args.warmup:
                continue
            wall_ms.append(elapsed)
            total = 0.0
            for name in per_unit:
                ms = times[name].ms.get("update", 0.0) if name in times else 0.0
                per_unit[name].append(ms)
                total += ms
            host_ms.append(total)
    return {
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "compare")},
        "host_update_ms": host_ms,
        "wall_ms": wall_ms,
        "per_unit_ms": per_unit,
        "calls": {thread: dict(counts) for thread, counts in counter.counts.items()},
    }


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _summary(result: dict) -> str:
    lines = [
        f"host update {_median(result['host_update_ms']):8.1f} ms/step (median of {len(result['host_update_ms'])}), "
        f"wall {_median(result['wall_ms']):8.1f} ms/step"
    ]
    for name, values in result["per_unit_ms"].items():
        lines.append(f"  {name:<12} {_median(values):8.1f} ms")
    return "\n".join(lines)


def _compare(paths: list[Path]) -> None:
    """Per unit and in total, the median of each file's medians: repeated runs of one tree share a label
    (the file name up to its first '.')."""
    groups: dict[str, list[dict]] = {}
    for path in paths:
        groups.setdefault(path.name.split(".")[0], []).append(json.loads(path.read_text()))
    labels = list(groups)
    units = list(next(iter(groups.values()))[0]["per_unit_ms"])

    def med(label: str, key: str, unit: str | None = None) -> float:
        runs = groups[label]
        if unit is None:
            return _median([_median(run[key]) for run in runs])
        return _median([_median(run["per_unit_ms"][unit]) for run in runs])

    print(f"{'':<14}" + "".join(f"{label:>14}" for label in labels))
    print(f"{'runs':<14}" + "".join(f"{len(groups[label]):>14}" for label in labels))
    print(f"{'host update':<14}" + "".join(f"{med(label, 'host_update_ms'):>14.1f}" for label in labels))
    print(f"{'wall':<14}" + "".join(f"{med(label, 'wall_ms'):>14.1f}" for label in labels))
    for unit in units:
        print(f"{unit:<14}" + "".join(f"{med(label, '', unit):>14.1f}" for label in labels))
    counted = {label: runs[0].get("calls") for label, runs in groups.items() if runs[0].get("calls")}
    if len(counted) < 2:
        return
    threads = sorted({thread for calls in counted.values() for thread in calls})
    for thread in threads:
        names = sorted({name for calls in counted.values() for name in calls.get(thread, {})})
        rows = [(name, [calls.get(thread, {}).get(name, 0) for calls in counted.values()]) for name in names]
        differ = [(name, values) for name, values in rows if len(set(values)) > 1]
        total = [sum(values) for values in zip(*(values for _, values in rows), strict=True)] if rows else []
        print(f"calls on {thread}: " + ", ".join(map(str, total)) + f" ({len(differ)} callables differ)")
        for name, values in differ:
            print(f"  {name:<40}" + "".join(f"{value:>10}" for value in values))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tied", action="store_true", help="tie the head to the embedding")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="compute (and gradient) dtype")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32, help="tokens per row: short, so the optimizer dominates")
    p.add_argument("--chunk-numel", type=int, default=16 * 1024 * 1024, help="EngineConfig.transfer_chunk_numel")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--resident", nargs="*", default=[], help="unit names kept on the device")
    p.add_argument("--max-grad-norm", type=float, default=0.0)
    p.add_argument("--no-grad-norm", action="store_true", help="report_grad_norm=False")
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--count-calls", action="store_true", help="count C-level calls per thread (slower)")
    p.add_argument("--json", type=Path, default=None, help="write the per-step numbers here")
    p.add_argument("--compare", type=Path, nargs="+", default=None, help="summarise these JSON files instead")
    args = p.parse_args()
    if args.compare:
        _compare(args.compare)
        return
    result = _run(args)
    print(_summary(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
