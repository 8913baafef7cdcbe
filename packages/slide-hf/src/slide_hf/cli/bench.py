"""`slide bench`: timed training steps on a preset or model directory; one JSON result.

TFLOPS counts 6·N + 12·L·H·S FLOPs per token (forward + backward matmuls and attention scores); the
recompute forward of the sliding engine is not counted. See slide_hf/bench.py for every reported field.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from slide_hf.errors import UserError
from slide_hf.options import Rule
from slide_hf.sizes import SIZE_RULE
from slide_hf.spelling import option

EPILOG = """examples:
  slide bench --model llama3.2-3b --batch-size 16 --seq-len 1024 --compare plain
  slide bench --model llama3.1-8b --gpu-memory 24 --trace out/trace
  slide bench --model llama3.1-8b --gpu-memory 24 --offload-optimizer nvme --nvme-dir /mnt/nvme
  slide bench --model qwen3.5-35b-a3b --layers 4 --gpu-memory 24
"""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from slide_hf.options import add_options

    parser = commands.add_parser(
        "bench",
        help="timed training steps, optionally against plain PyTorch",
        description=__doc__,
        epilog=EPILOG + "\n" + SIZE_RULE + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(parser, "bench")  # the options it shares with `slide train`, as slide_hf/options/config.py declares
    add = parser.add_argument
    add("--warmup", type=int, default=2, help="steps excluded from the median (default 2)")
    add("--resident-gib", type=float, help="GPU GiB for device-resident units (default: what the cap leaves)")
    add(
        "--no-grad-norm",
        action="store_true",
        help="do not report each step's gradient norm (as slide train with --grad-accum > 1 and no clipping)",
    )
    add(
        "--layers",
        type=int,
        help="run only the model's first N decoder layers, with every shape unchanged: per-layer speed of a "
        "model whose whole state does not fit this host (default: all layers)",
    )
    add("--compare", choices=("plain",), help="also run plain PyTorch in the same invocation")
    add(
        "--trace",
        type=Path,
        help="write trace.json (Chrome) and timeline.png of the last two steps here, the boundary between them "
        "included (bench/trace_waits.py reads the trace's waits)",
    )
    add("--json", type=Path, help="also write the result to this file")


def run(args: argparse.Namespace) -> int:
    from slide_hf.bench import BenchConfig, run_bench
    from slide_hf.options import TrainConfig, given_options

    # The options shared with `slide train`, by its rules; then the benchmark's own numbers.
    options = TrainConfig.for_command("bench", **given_options(args, "bench"))
    _check_options(args)
    assert options.steps is not None  # bench declares a default
    if options.steps <= args.warmup:
        raise UserError(f"{option('steps')} ({options.steps}) must exceed --warmup ({args.warmup})")
    cfg = BenchConfig(
        options,
        warmup=args.warmup,
        resident_gib=args.resident_gib,
        compare_plain=args.compare == "plain",
        trace_dir=args.trace,
        report_grad_norm=not args.no_grad_norm,
        layers=args.layers,
    )
    # The outputs are checked before the benchmark, which takes minutes, rather than failing after it.
    if args.json is not None:
        _check_writable_file(args.json, "--json")
    if args.trace is not None:
        _check_writable_dir(args.trace, "--trace")
    try:
        result = run_bench(cfg)
    except ValueError as error:
        raise UserError(str(error)) from error
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        try:
            args.json.write_text(text)
        except OSError as error:
            raise UserError(f"cannot write --json {args.json}: {error.strerror or error}") from None
    return 0


_BENCH_RULES = {
    "steps": Rule("int", 1, 10**6),
    "warmup": Rule("int", 0, 10**6),
    "resident_gib": Rule("float", 0, 2**20),
    "layers": Rule("int", 1, 10**6),
}
"""Bench-only numbers (GiB as floats, step counts, and timed steps a benchmark can take); the options shared
with `slide train` use its rules (slide_hf/options), --gpu-memory the one size grammar (slide_hf.sizes)."""


def _check_options(args: argparse.Namespace) -> None:
    for name, rule in _BENCH_RULES.items():
        value = getattr(args, name)
        if value is not None and not rule.accepts(value):
            raise UserError(f"{option(name)} must be {rule.describe()}, got {value!r}")


def _check_writable_file(path: Path, flag: str) -> None:
    """Open ``path`` for appending (creating it only for the test): what the final write will need."""
    existed = path.exists()
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file name")
    try:
        with path.open("a"):
            pass
    except OSError as error:
        raise UserError(f"cannot write {flag} {path}: {error.strerror or error}") from None
    if not existed:
        path.unlink(missing_ok=True)


def _check_writable_dir(path: Path, flag: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise UserError(f"cannot write {flag} {path}: {error.strerror or error}") from None
