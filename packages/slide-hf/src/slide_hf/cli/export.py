"""`slide export`: turn a training checkpoint into a Hugging Face model directory.

Takes a run's output directory (its newest checkpoint) or one checkpoint directory, and writes
config.json, sharded safetensors with an index and the tokenizer files, atomically. This is also how a
run whose final export failed (a full disk, a signal) gets its model: ``slide export RUN RUN/model``.
A checkpoint of a data-parallel run (every rank's shards under one step directory) is read shard by
shard into one master, so its export equals the run's own.
Weights holding NaN or Inf are refused, naming the first such tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path

log = logging.getLogger("slide.export")

EPILOG = """examples:
  slide export runs/llama8b out/llama8b --push-to-hub me/llama8b-chat --private
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
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing export (a directory holding a model) at OUTPUT"
    )
    parser.add_argument(
        "--push-to-hub", metavar="REPO", help="also upload the export to this Hub repository (org/name)"
    )
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")


def run(args: argparse.Namespace) -> int:
    import torch

    from slide_core import HostParameters
    from slide_core.checkpoint import CheckpointCorrupt, find_latest
    from slide_core.sharded_checkpoint import load_gathered
    from slide_hf import build_model, load_config
    from slide_hf.errors import UserError
    from slide_hf.resume import corrupt_message
    from slide_hf.run_dir import clean_if_idle, locked, run_of
    from slide_hf.run_export import export_model

    out = args.output.expanduser()

    def use(intact: Path) -> str:
        return f"export it with `slide export {intact} {out}`"

    try:
        checkpoint = find_latest(args.checkpoint)
    except CheckpointCorrupt as error:
        raise UserError(str(error)) from None
    run_dir = run_of(checkpoint)
    clean_if_idle(run_dir)  # temp dirs of a killed run or export, unless a live run holds the directory
    if out.exists() and not args.overwrite:
        raise UserError(f"{out} already exists; choose another output directory, or pass --overwrite to replace it")
    if out.exists() and not _holds_a_model(out):
        raise UserError(f"--overwrite replaces only a model directory; {out} holds no config.json and safetensors")
    config_dir, tokenizer_dir = run_dir / "config", run_dir / "tokenizer"
    if not (config_dir / "config.json").is_file():
        raise UserError(f"{run_dir} has no config/config.json next to its checkpoints (not a slide train run?)")
    try:
        config = load_config(config_dir)
        model = build_model(config)
    except ValueError as error:  # a damaged config.json, a model type this version cannot build
        raise UserError(f"{run_dir}: {str(error).strip().splitlines()[0]}") from None
    host = HostParameters(model)
    try:
        state = load_gathered(checkpoint, {"master": host.slab}, [unit.layout.numel for unit in model.units])
    except CheckpointCorrupt as error:
        raise UserError(corrupt_message(error, use)) from None
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.save_dtype]
    tokenizer = tokenizer_dir if tokenizer_dir.is_dir() else None
    if tokenizer is None:
        log.warning("%s has no tokenizer/: the export carries no tokenizer files", run_dir)
    inside_run = out.resolve().is_relative_to(run_dir.resolve())
    with locked(run_dir) if inside_run else contextlib.nullcontext():  # writing into a run: not while it runs
        export_model(model, host, config, out, dtype=dtype, tokenizer_dir=tokenizer, overwrite=args.overwrite)
    print(f"exported step {state['step']} of {checkpoint} to {out}")
    if args.push_to_hub:
        from slide_hf.hub import push_to_hub

        url = push_to_hub(out, args.push_to_hub, private=args.private, message=f"slide export of step {state['step']}")
        print(f"pushed {out} to {url}")
    return 0


def _holds_a_model(directory: Path) -> bool:
    """What --overwrite may replace: an HF model directory (never a folder of the user's other files)."""
    return directory.is_dir() and (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))
