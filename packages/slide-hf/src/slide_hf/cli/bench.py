"""`slide bench`: timed training steps on a preset or model directory; one JSON result.

TFLOPS counts 6·N + 12·L·H·S FLOPs per token (forward + backward matmuls and attention scores); the
recompute forward of the sliding engine is not counted. See slide_hf/bench.py for every reported field.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

EPILOG = """examples:
  slide bench --model llama3.2-3b --batch-size 16 --seq-len 1024 --compare plain
  slide bench --model llama3.1-8b --gpu-memory 24 --trace out/trace
  slide bench --model llama3.1-8b --gpu-memory 24 --offload-optimizer nvme --nvme-dir /mnt/nvme
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "bench",
        help="timed training steps, optionally against plain PyTorch",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default="llama3.2-3b", help="preset or HF model directory (default llama3.2-3b)")
    add("--batch-size", type=int, default=16)
    add("--seq-len", type=int, default=1024)
    add("--steps", type=int, default=6, help="timed steps including warmup (default 6)")
    add("--warmup", type=int, default=2, help="steps excluded from the median (default 2)")
    add("--gpu-memory", type=float, help="GPU cap in GiB for the engine (default: the whole card)")
    add("--resident-gib", type=float, help="GPU GiB for device-resident units (default: what the cap leaves)")
    add("--block-slots", type=int, default=2)
    add("--optimizer", choices=("auto", "torch", "fused"), default="auto", help="host AdamW implementation")
    add("--max-grad-norm", type=float, default=0.0, help="exact global clipping (default 0 = off)")
    add("--offload-optimizer", choices=("ram", "nvme"), default="ram", help="where Adam m and v live (default ram)")
    add("--nvme-dir", type=Path, help="directory on NVMe for offloaded state")
    add("--nvme-fraction", type=float, default=1.0, help="fraction of units whose state goes to NVMe (default 1.0)")
    add("--compare", choices=("plain",), help="also run plain PyTorch in the same invocation")
    add("--trace", type=Path, help="write trace.json (Chrome) and timeline.png of the last step here")
    add("--json", type=Path, help="also write the result to this file")


def run(args: argparse.Namespace) -> int:
    from slide_hf.bench import BenchConfig, run_bench
    from slide_hf.errors import UserError

    if args.steps <= args.warmup:
        raise UserError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.batch_size < 1 or args.seq_len < 2:
        raise UserError("--batch-size must be >= 1 and --seq-len >= 2")
    if args.offload_optimizer == "nvme" and args.nvme_dir is None:
        raise UserError("--offload-optimizer nvme needs --nvme-dir PATH (a directory on a fast local disk)")
    if not 0.0 <= args.nvme_fraction <= 1.0:
        raise UserError(f"--nvme-fraction must be in [0, 1], got {args.nvme_fraction}")
    cfg = BenchConfig(
        model=args.model,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        steps=args.steps,
        warmup=args.warmup,
        gpu_memory_gib=args.gpu_memory,
        resident_gib=args.resident_gib,
        block_slots=args.block_slots,
        compare_plain=args.compare == "plain",
        trace_dir=args.trace,
        optimizer=args.optimizer,
        max_grad_norm=args.max_grad_norm,
        offload_optimizer=args.offload_optimizer,
        nvme_dir=args.nvme_dir,
        nvme_fraction=args.nvme_fraction,
    )
    try:
        result = run_bench(cfg)
    except ValueError as error:
        raise UserError(str(error)) from error
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text)
    return 0
