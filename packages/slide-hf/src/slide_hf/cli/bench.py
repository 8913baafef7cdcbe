"""`slide bench`: timed training steps on a preset or model directory; one JSON result.

TFLOPS counts 6·N + 12·L·H·S FLOPs per token (forward + backward matmuls and attention scores); the
recompute forward of the sliding engine is not counted. See slide_hf/bench.py for every reported field.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from slide_hf.defaults import DEFAULT_SEQ_LEN
from slide_hf.errors import UserError
from slide_hf.options import Rule, check_option, installed_names
from slide_hf.sizes import SIZE_RULE, parse_size

EPILOG = """examples:
  slide bench --model llama3.2-3b --batch-size 16 --seq-len 1024 --compare plain
  slide bench --model llama3.1-8b --gpu-memory 24 --trace out/trace
  slide bench --model llama3.1-8b --gpu-memory 24 --offload-optimizer nvme --nvme-dir /mnt/nvme
  slide bench --model qwen3.5-35b-a3b --layers 4 --gpu-memory 24
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "bench",
        help="timed training steps, optionally against plain PyTorch",
        description=__doc__,
        epilog=EPILOG + "\n" + SIZE_RULE + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default="llama3.2-3b", help="preset or HF model directory (default llama3.2-3b)")
    add("--batch-size", type=int, default=16)
    add(
        "--seq-len",
        type=int,
        help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}, or the model's context length if shorter)",
    )
    add("--steps", type=int, default=6, help="timed steps including warmup (default 6)")
    add("--warmup", type=int, default=2, help="steps excluded from the median (default 2)")
    add("--gpu-memory", help="GPU cap for the engine, e.g. 24 (GiB), 24GiB or 80GB (default: the whole card)")
    add("--resident-gib", type=float, help="GPU GiB for device-resident units (default: what the cap leaves)")
    add(
        "--no-grad-norm",
        action="store_true",
        help="do not report each step's gradient norm (as slide train with --grad-accum > 1 and no clipping)",
    )
    add("--block-slots", type=int, default=2)
    add(
        "--layers",
        type=int,
        help="run only the model's first N decoder layers, with every shape unchanged: per-layer speed of a "
        "model whose whole state does not fit this host (default: all layers)",
    )
    add(
        "--device",
        metavar="NAME",
        default="auto",
        help=f"compute device, one of {installed_names('device')} (default auto, as slide train)",
    )
    add(
        "--optimizer",
        metavar="NAME",
        default="auto",
        help=f"host AdamW, one of {installed_names('optimizer')} (default auto, as slide train; "
        "torch and fused are short for torch-adamw and fused-adamw)",
    )
    add(
        "--optimizer-state",
        choices=("fp32", "bf16", "int8"),
        default="fp32",
        help="how AdamW keeps exp_avg and exp_avg_sq between steps: fp32 (exact, 8 B/param), bf16 (4 B/param) or "
        "int8 (~2 B/param), stochastically rounded (default fp32)",
    )
    add(
        "--master",
        choices=("auto", "fp32", "split"),
        default="fp32",
        help="how the host stores the fp32 master: split (a bf16 plane the GPU copies as it is, half the host-to-device bytes, plus the low 16 bits and a tie bit: exact; bf16 only), fp32 (default), or auto (split when it can run)",
    )
    add("--max-grad-norm", type=float, default=0.0, help="exact global clipping (default 0 = off)")
    add(
        "--offload-optimizer",
        metavar="NAME",
        default="ram",
        help=f"the tier for the Adam m and v of --nvme-fraction of the units, one of "
        f"{installed_names('offload_optimizer')} (default ram)",
    )
    add("--nvme-dir", type=Path, help="directory on NVMe for offloaded state")
    add("--nvme-fraction", type=float, default=1.0, help="fraction of units whose state goes to NVMe (default 1.0)")
    add("--compare", choices=("plain",), help="also run plain PyTorch in the same invocation")
    add("--trace", type=Path, help="write trace.json (Chrome) and timeline.png of the last step here")
    add("--json", type=Path, help="also write the result to this file")


def run(args: argparse.Namespace) -> int:
    from slide_hf.bench import BenchConfig, run_bench
    from slide_hf.setup import check_nvme_dir

    args.optimizer = OPTIMIZER_ALIASES.get(args.optimizer, args.optimizer)
    _check_options(args)
    if args.steps <= args.warmup:
        raise UserError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    cfg = BenchConfig(
        model=args.model,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        steps=args.steps,
        warmup=args.warmup,
        gpu_memory_gib=None if args.gpu_memory is None else parse_size(args.gpu_memory, what="--gpu-memory") / 2**30,
        report_grad_norm=not args.no_grad_norm,
        resident_gib=args.resident_gib,
        block_slots=args.block_slots,
        compare_plain=args.compare == "plain",
        trace_dir=args.trace,
        device=args.device,
        optimizer=args.optimizer,
        optimizer_state=args.optimizer_state,
        master=args.master,
        max_grad_norm=args.max_grad_norm,
        offload_optimizer=args.offload_optimizer,
        nvme_dir=args.nvme_dir,
        nvme_fraction=args.nvme_fraction,
        layers=args.layers,
    )
    check_nvme_dir(cfg.run_options())
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


OPTIMIZER_ALIASES = {"torch": "torch-adamw", "fused": "fused-adamw"}
"""The names `slide bench --optimizer` took before optimizers were plugins."""

_BENCH_RULES = {
    "steps": ("--steps", Rule("int", 1, 10**6)),
    "warmup": ("--warmup", Rule("int", 0, 10**6)),
    "resident_gib": ("--resident-gib", Rule("float", 0, 2**20)),
    "layers": ("--layers", Rule("int", 1, 10**6)),
}
"""Bench-only numbers (GiB as floats, step counts); the options shared with `slide train` use its rules, and
--gpu-memory the one size grammar (slide_hf.sizes)."""


def _check_options(args: argparse.Namespace) -> None:
    for name in (
        "batch_size",
        "seq_len",
        "block_slots",
        "max_grad_norm",
        "nvme_fraction",
        "device",
        "optimizer",
        "offload_optimizer",
    ):
        check_option(name, getattr(args, name))
    if args.gpu_memory is not None:
        parse_size(args.gpu_memory, what="--gpu-memory")
    for name, (flag, rule) in _BENCH_RULES.items():
        value = getattr(args, name)
        if value is not None and not rule.accepts(value):
            raise UserError(f"{flag} must be {rule.describe()}, got {value!r}")


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
