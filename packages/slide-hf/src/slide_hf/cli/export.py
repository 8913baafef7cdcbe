"""`slide export`: turn a training checkpoint into a Hugging Face model directory.

Takes a run's output directory or one checkpoint directory, and writes config.json, sharded safetensors
with an index and the tokenizer files, atomically. Of a run it exports the checkpoint the run's own
model/ is the export of: its newest, or for a run trained with --save-best its best one (the lowest eval
loss, named in checkpoints/best.json); name a checkpoint to export another. This is also how a run whose
final export failed (a full disk, a signal) gets its model: ``slide export RUN RUN/model``.
A checkpoint of a data-parallel run (every rank's shards under one step directory) is read shard by
shard into one master, so its export equals the run's own.
Weights holding NaN or Inf are refused, naming the first such tensor.

A run that is still training prunes its old checkpoints as it saves new ones. A checkpoint that vanishes
while the export reads it (its directory gone, or going while the run holds its lock) was never a
corrupt one: the export falls back to the newest checkpoint that is still complete, and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slide_hf.model_checkpoint import ModelCheckpoint

log = logging.getLogger("slide.export")

EPILOG = """examples:
  slide export runs/llama8b out/llama8b --push-to-hub me/llama8b-chat --private
  slide export runs/llama8b --push-to-hub me/llama8b-chat  # push the finished run's model/ as it is
  slide export runs/llama8b out/llama8b-step-2000          # newest checkpoint of the run (--save-best: best)
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
    parser.add_argument(
        "output",
        type=Path,
        nargs="?",
        help="the HF directory to write (must not exist); left out with --push-to-hub, the run's own model/ is "
        "pushed (exported first if the run has none)",
    )
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
    from slide_core.checkpoint import CheckpointCorrupt, list_checkpoints, load_checkpoint
    from slide_hf import build_model, load_config
    from slide_hf.errors import UserError
    from slide_hf.model_checkpoint import model_checkpoint
    from slide_hf.resume import corrupt_message, damaged_newest
    from slide_hf.run_dir import clean_if_idle, exporting_into, run_of
    from slide_hf.run_export import export_model

    if args.output is None:  # push the run's own model: `slide train --push-to-hub`'s retry
        from slide_hf.hub import finished_model

        model_dir, final_step = finished_model(args.checkpoint.expanduser(), args.push_to_hub)
        if final_step is not None:
            return _push_finished(args.checkpoint.expanduser(), model_dir, final_step, args)
        args.output = model_dir
    out = args.output.expanduser()

    def use(intact: Path) -> str:
        return f"export it with `slide export {intact} {out}`"

    # A run's newest step folder without its state.json is damage, not a checkpoint to skip silently.
    damaged = None if (args.checkpoint / "state.json").exists() else damaged_newest(args.checkpoint)
    if damaged is not None:
        raise UserError(corrupt_message(damaged, use))
    try:
        # A run: the checkpoint its model/ is the export of, the newest or with --save-best the best one.
        chosen = model_checkpoint(args.checkpoint)
    except CheckpointCorrupt as error:
        raise UserError(str(error)) from None
    checkpoint = chosen.path
    named = checkpoint == args.checkpoint  # the user named this checkpoint, not a run to take the newest of
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
    numels = [unit.layout.numel for unit in model.units]
    gone: set[Path] = set()
    while True:
        try:
            state = load_checkpoint(checkpoint, {"master": host.slab}, unit_numels=numels)
            break
        except (CheckpointCorrupt, FileNotFoundError) as error:
            if not _vanished(checkpoint, run_dir):
                if isinstance(error, FileNotFoundError):
                    raise
                raise UserError(corrupt_message(error, use)) from None
        if named:
            raise UserError(
                f"checkpoint {checkpoint} was removed while it was read (a live run pruned it); export the run, "
                f"`slide export {run_dir} {out}`, to take its newest complete checkpoint"
            )
        gone.add(checkpoint)
        better = _new_best(run_dir, gone) if chosen.is_best else None
        if better is not None:
            log.warning("%s was removed while it was read (a better one replaced it); exporting %s", checkpoint, better)
            chosen, checkpoint = better, better.path
            continue
        older = [p for p in list_checkpoints(checkpoint.parent) if p not in gone and p.name < checkpoint.name]
        if not older:
            raise UserError(f"every checkpoint of {run_dir} was removed while it was read; export again")
        log.warning("%s was removed while it was read (pruned by the live run); exporting %s", checkpoint, older[-1])
        checkpoint = older[-1]
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.save_dtype]
    tokenizer = tokenizer_dir if tokenizer_dir.is_dir() else None
    if tokenizer is None:
        log.warning("%s has no tokenizer/: the export carries no tokenizer files", run_dir)
    inside_run = out.resolve().is_relative_to(run_dir.resolve())
    # Writing into a run: not while it runs, and the user's files in its model/ stay.
    with exporting_into(run_dir, out) if inside_run else contextlib.nullcontext():
        export_model(model, host, config, out, dtype=dtype, tokenizer_dir=tokenizer, overwrite=args.overwrite)
    best = ""
    if chosen.eval_loss is not None and chosen.path == checkpoint:
        best = f", the run's best (eval loss {chosen.eval_loss:.4f}, --save-best),"
    print(f"exported step {state['step']} of {checkpoint}{best} to {out}")
    if args.push_to_hub:
        from slide_hf.hub import push_to_hub

        url = push_to_hub(out, args.push_to_hub, private=args.private, message=f"slide export of step {state['step']}")
        print(f"pushed {out} to {url}")
    return 0


def _push_finished(run_dir: Path, model_dir: Path, step: int, args: argparse.Namespace) -> int:
    """Push a finished run's ``model/`` as it is, holding the run so no resume rewrites it meanwhile."""
    from slide_hf.hub import push_run_model
    from slide_hf.run_dir import locked

    with locked(run_dir):
        url = push_run_model(run_dir, model_dir, args.push_to_hub, private=args.private, step=step)
    print(f"pushed {model_dir} (step {step}) to {url}")
    return 0


def _new_best(run_dir: Path, gone: set[Path]) -> ModelCheckpoint | None:
    """The best checkpoint a live ``--save-best`` run names now, when it is not one already found gone (the
    run names a better one in best.json before it prunes the older best); ``None`` otherwise."""
    from slide_core.checkpoint import CheckpointCorrupt
    from slide_hf.model_checkpoint import model_checkpoint

    try:
        found = model_checkpoint(run_dir)
    except CheckpointCorrupt:
        return None
    return found if found.is_best and found.path not in gone else None


def _vanished(checkpoint: Path, run_dir: Path, *, wait_s: float = 5.0) -> bool:
    """Whether ``checkpoint`` is gone or going: its ``state.json`` (what marks a complete checkpoint) is
    absent, or disappears within ``wait_s`` while a live run holds the run directory (pruning removes a
    checkpoint's files one by one). A damaged checkpoint of an idle run answers at once: it stays."""
    deadline = time.monotonic() + wait_s
    while (checkpoint / "state.json").is_file():
        if time.monotonic() > deadline or not _held_by_a_run(run_dir):
            return False
        time.sleep(0.05)
    return True


def _held_by_a_run(run_dir: Path) -> bool:
    """Whether a live `slide train` holds ``run_dir``'s lock (a shared, non-blocking probe that writes
    nothing: an idle run's lock file is left as it is)."""
    from slide_hf.run_dir import LOCK_FILE

    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops a lock the probe took
    return False


def _holds_a_model(directory: Path) -> bool:
    """What --overwrite may replace: an HF model directory (never a folder of the user's other files)."""
    return directory.is_dir() and (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))
