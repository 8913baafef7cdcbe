"""`slide export`: turn a training checkpoint into a Hugging Face model directory.

Takes a run's output directory (its newest checkpoint) or one checkpoint directory, and writes
config.json, sharded safetensors with an index and the tokenizer files, atomically.
"""

from __future__ import annotations

import argparse
from pathlib import Path

EPILOG = """examples:
  slide export runs/llama8b out/llama8b-step-2000          # newest checkpoint of the run
  slide export runs/llama8b/checkpoints/step-00001000 out/step-1000 --save-dtype bfloat16
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export",
        help="write an HF model directory from a training checkpoint",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", type=Path, help="a run's output directory or one of its checkpoints")
    parser.add_argument("output", type=Path, help="the HF directory to write (must not exist)")
    parser.add_argument("--save-dtype", choices=("auto", "float32", "bfloat16"), default="auto")


def run(args: argparse.Namespace) -> int:
    import torch

    from slide_core import HostParameters
    from slide_core.checkpoint import CheckpointCorrupt, find_latest, load_checkpoint
    from slide_hf import build_model, export_hf, load_config
    from slide_hf.errors import UserError

    try:
        checkpoint = find_latest(args.checkpoint)
    except CheckpointCorrupt as error:
        raise UserError(str(error)) from None
    run_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    config_dir, tokenizer_dir = run_dir / "config", run_dir / "tokenizer"
    if not (config_dir / "config.json").is_file():
        raise UserError(f"{run_dir} has no config/config.json next to its checkpoints (not a slide train run?)")
    config = load_config(config_dir)
    model = build_model(config)
    host = HostParameters(model)
    try:
        state = load_checkpoint(checkpoint, {"master": host.slab})
    except CheckpointCorrupt as error:
        raise UserError(str(error)) from None
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.save_dtype]
    tokenizer = tokenizer_dir if tokenizer_dir.is_dir() else None
    try:
        export_hf(model, host, config, args.output, dtype=dtype, tokenizer_dir=tokenizer)
    except (FileExistsError, ValueError) as error:
        raise UserError(str(error)) from None
    print(f"exported step {state['step']} of {checkpoint} to {args.output}")
    return 0
