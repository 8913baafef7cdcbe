"""`slide train`: fine-tune every parameter of a model, then write an HF directory.

Options can also come from ``--config FILE.toml`` with the same names (underscores); flags given on the
command line win over the file.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slide_hf.errors import UserError

if TYPE_CHECKING:
    from slide_hf.options import TrainConfig

EPILOG = """examples:
  slide train                                   # tiny-llama on bundled text, CPU or GPU
  slide train --model ./Llama-3.1-8B --data train.jsonl --gpu-memory 24GiB
  slide train --config run.toml --steps 100 --metrics metrics.jsonl
  slide train --model ./Llama-3.1-8B --data train.jsonl --nproc-per-node 8   # 8 GPUs, data parallel
"""


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from slide_hf.options import add_options
    from slide_hf.sizes import SIZE_RULE

    parser = commands.add_parser(
        "train",
        help="fine-tune a model (default: tiny-llama on bundled text)",
        description=__doc__,
        epilog=EPILOG + "\n" + SIZE_RULE + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, help="TOML file with any of these options (underscored names)")
    add_options(parser, "train")  # every option as slide_hf/options/config.py declares it


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options the user gave, from ``--config`` and the flags (flags win), as TrainConfig field values."""
    from slide_hf import options

    values = options.toml_options(args.config) if args.config is not None else {}
    values.update(options.given_options(args, "train"))
    return values


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The run's TrainConfig: the given options, or for ``--resume`` the saved run's options updated by them."""
    from slide_hf.options import TrainConfig, resume_config
    from slide_hf.options.companions import check_given

    values = given_options(args)
    if values.get("resume") is not None:
        from slide_hf.run_options import saved_options

        saved, source = saved_options(Path(values["resume"]))
        cfg = resume_config(saved, values, source=source)
    else:
        from slide_hf.run_options import init_model_options

        values = init_model_options(values)  # --init-from RUN without --model: that run's model
        try:
            cfg = TrainConfig(**values)
        except TypeError as error:
            raise UserError(f"bad option value: {error}") from None
    check_given(cfg, values)  # an option written that the run would not use (--decay-shape without wsd)
    return cfg


def run(args: argparse.Namespace) -> int:
    from slide_hf.recipe import train

    if args.nproc_per_node is not None:  # this process becomes torch's launcher of N copies of this command
        from slide_hf.launch import check_gpus_for_ranks, check_ranks_for_cores, relaunch

        cfg = build_config(args)  # the flags and the --config file, refused here before any process starts
        cfg.validate(args.nproc_per_node)
        check_ranks_for_cores(cfg.device, args.nproc_per_node)
        check_gpus_for_ranks(cfg.device, args.nproc_per_node)
        return relaunch(args.nproc_per_node, args.argv)

    cfg = build_config(args)
    if args.config is not None:  # the TOML file is an input too: --overwrite must not remove it
        from slide_hf.run_dir import check_overwrite_inputs

        check_overwrite_inputs(cfg, [("config", args.config)])
    summary = train(cfg)
    if os.environ.get("RANK") not in (None, "", "0"):  # rank 0 reports the run (cli/main.py)
        return 0
    if summary.steps == 0:  # a finished run, resumed: only its model was written again
        print(f"nothing left to train in {summary.output}")
    else:
        print(f"trained {summary.steps} steps: loss {summary.first_loss:.4f} -> {summary.last_loss:.4f}")
    print(f"model written to {summary.model_dir}")
    return 0
