"""`slide train`: fine-tune every parameter of a model, then write an HF directory.

Options can also come from ``--config FILE.toml`` with the same names (underscores); flags given on the
command line win over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from slide_hf.errors import UserError

EPILOG = """examples:
  slide train                                   # tiny-llama on bundled text, CPU or GPU
  slide train --model ./Llama-3.1-8B --data train.jsonl --gpu-memory 24GiB
  slide train --config run.toml --steps 100 --metrics metrics.jsonl
  slide train --model ./Llama-3.1-8B --data train.jsonl --nproc-per-node 8   # 8 GPUs, data parallel
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    from slide_hf.defaults import DEFAULT_SEQ_LEN, DEMO_SEQ_LEN
    from slide_hf.options import REPORTERS, TrainConfig, installed_names
    from slide_hf.sizes import SIZE_RULE

    parser = commands.add_parser(
        "train",
        help="fine-tune a model (default: tiny-llama on bundled text)",
        description=__doc__,
        epilog=EPILOG + "\n" + SIZE_RULE + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = TrainConfig()
    add = parser.add_argument
    add("--config", type=Path, help="TOML file with any of these options (underscored names)")
    add(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="data parallel on this host: run N processes, one per GPU, as torchrun would (docs/distributed.md)",
    )
    add("--model", help=f"HF model directory, Hub name (org/name) or preset (default {defaults.model})")
    add("--tokenizer", type=Path, help="tokenizer directory, when the model directory has none")
    add(
        "--data",
        action="append",
        help="JSON Lines (.jsonl, .jsonl.gz), .json, .parquet or a Hub dataset (default: bundled text); repeat it "
        "to train on several sources (concatenated, or sampled by --data-weights)",
    )
    add(
        "--data-weights",
        metavar="W1,W2,...",
        help="sampling proportions of the --data sources, one positive number each (e.g. 3,1): seeded, resumable",
    )
    add(
        "--max-record-size",
        metavar="SIZE",
        help="refuse a record (a JSON line or object) larger than this before parsing it (default 8MiB)",
    )
    add("--output", type=Path, help="output directory (default runs/<timestamp>-<suffix>)")
    add("--overwrite", action="store_true", default=None, help="reuse a non-empty --output, replacing slide's files")
    add(
        "--device",
        metavar="NAME",
        help=f"compute device, one of {installed_names('device')} (default auto: cuda, rocm on a HIP build "
        "of torch, else cpu)",
    )
    add("--dtype", choices=("bfloat16", "float32"), help="compute dtype (default bfloat16)")
    add(
        "--seq-len",
        type=int,
        help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}, or the model's context length if shorter; "
        f"{DEMO_SEQ_LEN} on the bundled demo text)",
    )
    add("--no-packing", dest="packing", action="store_false", default=None, help="one example per row (padded)")
    add("--train-on-inputs", action="store_true", default=None, help="loss on prompts and user turns too")
    add("--chat-template", help="chat template file (.jinja) or a bundled name, instead of the tokenizer's")
    add("--batch-size", type=int, help=f"sequences per micro-batch (default {defaults.batch_size})")
    add("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    add("--steps", type=int, help="optimizer steps (default: --epochs over the data)")
    add("--epochs", type=int, help="passes over the data (default 1; 10 for the bundled demo text)")
    add("--lr", type=float, help="peak learning rate (default 1e-3 for presets, 2e-5 for checkpoints)")
    add("--weight-decay", type=float, help="AdamW weight decay on >= 2-dim params (default 0)")
    add(
        "--optimizer",
        metavar="NAME",
        help=f"host AdamW, one of {installed_names('optimizer')} (default auto: fused-adamw when numba "
        "runs here, else torch-adamw)",
    )
    add(
        "--optimizer-state",
        choices=("fp32", "bf16", "int8"),
        help="how AdamW keeps exp_avg and exp_avg_sq between steps: fp32 (exact, 8 B/param), bf16 (4 B/param) or "
        "int8 (~2 B/param), stochastically rounded (default fp32)",
    )
    add(
        "--master",
        choices=("auto", "fp32", "split"),
        help="how the host stores the fp32 master: split (a bf16 plane the GPU copies as it is, half the host-to-device bytes, plus the low 16 bits and a tie bit: exact; bf16 only), fp32 (default), or auto (split when it can run)",
    )
    add("--adam-beta1", type=float, help="default 0.9")
    add("--adam-beta2", type=float, help="default 0.999")
    add("--adam-eps", type=float, help="default 1e-8")
    add(
        "--lr-schedule",
        choices=("constant", "linear", "cosine", "wsd"),
        help="default linear; wsd: warmup, stable at --lr, then a decay over the last --decay-fraction of the steps",
    )
    add("--warmup-steps", type=int, help="linear warmup steps (default 0)")
    add("--min-lr-ratio", type=float, help="lr floor after warmup, as a fraction of --lr, in [0, 1) (default 0)")
    add("--decay-fraction", type=float, help="wsd: fraction of the steps that decay, in (0, 1] (default 0.1)")
    add("--decay-shape", choices=("linear", "cosine"), help="wsd: shape of the decay to the floor (default linear)")
    add(
        "--allow-data-change",
        action="store_true",
        default=None,
        help="with --resume: train on data that changed since the checkpoint, from the saved position",
    )
    add("--max-grad-norm", type=float, help="global gradient-norm clip, 0 = off (default 0)")
    add("--seed", type=int, help="seed for init and shuffling (default 0)")
    add("--no-shuffle", action="store_true", default=None, help="keep file order")
    add("--eval-data", type=Path, help="held-out data in any --data format, evaluated every --eval-every steps")
    add("--eval-fraction", type=float, help="hold out this fraction of --data's examples instead")
    add("--eval-every", type=int, help="evaluate every N steps (default 0: only at the end)")
    add("--save-best", action="store_true", default=None, help="keep the checkpoint with the lowest eval loss")
    add("--metrics", type=Path, help="JSON Lines metrics file (default <output>/metrics.jsonl)")
    add("--report-to", help=f"also log to these trackers, comma-separated: {', '.join(REPORTERS)}")
    add("--log-every", type=int, help="write a plain progress line every N steps when not on a terminal (default 1)")
    add("--save-every", type=int, help="checkpoint every N steps (default 0: only at the end)")
    add("--keep-checkpoints", type=int, help="how many checkpoints to keep (default 2)")
    add(
        "--resume",
        type=Path,
        help="continue a run: its output directory or one of its checkpoints; the run's "
        "options come back with it, and only steps, saving, evaluation, logging and placement may change",
    )
    add("--gpu-memory", help="hard GPU memory cap, e.g. 24 (GiB), 24GiB or 80GB")
    add(
        "--offload-optimizer",
        metavar="NAME",
        help=f"the tier for the Adam state of --nvme-fraction of the units, one of "
        f"{installed_names('offload_optimizer')} (default ram: host RAM, nothing offloaded)",
    )
    add("--nvme-dir", type=Path, help="directory on NVMe for offloaded state")
    add("--nvme-fraction", type=float, help="fraction of units whose state goes to NVMe (default 1.0)")
    add("--offload-activations", choices=("ram", "nvme"), help="where boundary activations go (default ram)")
    add("--save-dtype", choices=("auto", "float32", "bfloat16"), help="dtype of the exported model (default auto)")
    add("--block-slots", type=int, help="GPU slots for decoder blocks (default 2)")


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"config file {path} is a directory, not a TOML file") from None
    except OSError as error:
        raise UserError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"config file {path} is not valid TOML: {error}") from None
    return data


_TOML_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
_TOML_TYPES["Path"] = _TOML_TYPES["str"]


def _check_toml_value(path: Path, key: str, value: Any, annotation: str) -> None:
    """A TOML value of the wrong type (``steps = 2.5``, ``data = 5``) is named here, not deep in training.
    A ``tuple[X, ...]`` field takes a TOML list of X (``data = ["a.jsonl", "b.jsonl"]``)."""
    names = [name for name in str(annotation).split(" | ") if name != "None"]
    scalars = [name for name in names if not name.startswith("tuple[")]
    items = [name.removeprefix("tuple[").split(",")[0] for name in names if name.startswith("tuple[")]
    if isinstance(value, list) and items:
        if not all(_toml_type_ok(item, items) for item in value):
            raise UserError(f"config file {path}: {key} must be a list of {' or '.join(items)}, got {value!r}")
        return
    if not _toml_type_ok(value, scalars):
        wanted = " or ".join(scalars) if scalars else f"a list of {' or '.join(items)}"
        raise UserError(f"config file {path}: {key} must be {wanted}, got {value!r}")


def _toml_type_ok(value: Any, names: list[str]) -> bool:
    allowed = tuple(kind for name in names for kind in _TOML_TYPES.get(name, (object,)))
    return not (isinstance(value, bool) and bool not in allowed) and isinstance(value, allowed)


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options the user gave, from ``--config`` and the flags (flags win), as TrainConfig field values."""
    from slide_hf.options import TrainConfig

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    values: dict[str, Any] = {}
    if args.config is not None:
        for key, value in _from_toml(args.config).items():
            if key not in fields:
                raise UserError(f"config file {args.config}: unknown option {key!r}")
            _check_toml_value(args.config, key, value, fields[key].type)
            if key == "report_to" and isinstance(value, list):
                value = ",".join(value)
            values[key] = value
    for name in fields:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    return values


def build_config(args: argparse.Namespace):
    """The run's TrainConfig: the given options, or for ``--resume`` the saved run's options updated by them."""
    from slide_hf.options import TrainConfig, resume_config

    values = given_options(args)
    if values.get("resume") is not None:
        from slide_hf.run_options import saved_options

        saved, source = saved_options(Path(values["resume"]))
        return resume_config(saved, values, source=source)
    try:
        return TrainConfig(**values)
    except TypeError as error:
        raise UserError(f"bad option value: {error}") from None


def run(args: argparse.Namespace) -> int:
    from slide_hf.recipe import train

    if args.nproc_per_node is not None:  # this process becomes torch's launcher of N copies of this command
        from slide_hf.launch import check_gpus_for_ranks, check_ranks_for_cores, relaunch
        from slide_hf.options import check_data_parallel

        check_data_parallel(getattr(args, "optimizer_state", None) or "fp32", args.nproc_per_node)
        check_ranks_for_cores(getattr(args, "device", None) or "auto", args.nproc_per_node)
        check_gpus_for_ranks(getattr(args, "device", None) or "auto", args.nproc_per_node)
        return relaunch(args.nproc_per_node, args.argv)

    summary = train(build_config(args))
    if os.environ.get("RANK") not in (None, "", "0"):  # rank 0 reports the run (cli/main.py)
        return 0
    if summary.steps == 0:  # a finished run, resumed: only its model was written again
        print(f"nothing left to train in {summary.output}")
    else:
        print(f"trained {summary.steps} steps: loss {summary.first_loss:.4f} -> {summary.last_loss:.4f}")
    print(f"model written to {summary.model_dir}")
    return 0
