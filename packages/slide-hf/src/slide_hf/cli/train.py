"""`slide train`: fine-tune every parameter of a model, then write an HF directory.

Options can also come from ``--config FILE.toml`` with the same names (underscores); flags given on the
command line win over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from slide_hf.errors import UserError

EPILOG = """examples:
  slide train                                   # tiny-llama on bundled text, CPU or GPU
  slide train --model ./Llama-3.1-8B --data train.jsonl --gpu-memory 24GiB
  slide train --config run.toml --steps 100 --metrics metrics.jsonl
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    from slide_hf.recipe import TrainConfig

    parser = commands.add_parser(
        "train",
        help="fine-tune a model (default: tiny-llama on bundled text)",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = TrainConfig()
    add = parser.add_argument
    add("--config", type=Path, help="TOML file with any of these options (underscored names)")
    add("--model", help=f"HF model directory or preset (default {defaults.model})")
    add("--data", type=Path, help="JSON Lines file: text, messages or input_ids (default: bundled English text)")
    add("--output", type=Path, help="output directory (default runs/<timestamp>)")
    add("--device", choices=("auto", "cuda", "cpu"), help="compute device (default auto)")
    add("--dtype", choices=("bfloat16", "float32"), help="compute dtype (default bfloat16)")
    add("--seq-len", type=int, help=f"tokens per sequence (default {defaults.seq_len})")
    add("--batch-size", type=int, help=f"sequences per micro-batch (default {defaults.batch_size})")
    add("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    add("--steps", type=int, help="optimizer steps (default: --epochs over the data)")
    add("--epochs", type=int, help="passes over the data (default 1; 10 for the bundled demo text)")
    add("--lr", type=float, help="peak learning rate (default 1e-3 for presets, 2e-5 for checkpoints)")
    add("--weight-decay", type=float, help="AdamW weight decay on >= 2-dim params (default 0)")
    add("--adam-beta1", type=float, help="default 0.9")
    add("--adam-beta2", type=float, help="default 0.999")
    add("--adam-eps", type=float, help="default 1e-8")
    add("--lr-schedule", choices=("constant", "linear", "cosine"), help="default linear")
    add("--warmup-steps", type=int, help="linear warmup steps (default 0)")
    add("--max-grad-norm", type=float, help="global gradient-norm clip, 0 = off (default 0)")
    add("--seed", type=int, help="seed for init and shuffling (default 0)")
    add("--no-shuffle", action="store_true", default=None, help="keep file order")
    add("--metrics", type=Path, help="JSON Lines file with one record per optimizer step")
    add("--save-every", type=int, help="checkpoint every N steps (default 0 = none; the model is exported at the end)")
    add("--keep-checkpoints", type=int, help="how many checkpoints to keep (default 2)")
    add("--resume", type=Path, help="an output directory or one of its checkpoints")
    add("--gpu-memory", help="hard GPU memory cap, e.g. 24GiB")
    add("--offload-optimizer", choices=("ram", "nvme"), help="where Adam state lives (default ram)")
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
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"config file {path} is not valid TOML: {error}") from None
    return data


_TOML_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
_TOML_TYPES["Path"] = _TOML_TYPES["str"]


def _check_toml_value(path: Path, key: str, value: Any, annotation: str) -> None:
    """A TOML value of the wrong type (``steps = 2.5``, ``data = 5``) is named here, not deep in training."""
    names = [name for name in str(annotation).split(" | ") if name != "None"]
    allowed = tuple(kind for name in names for kind in _TOML_TYPES.get(name, (object,)))
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        raise UserError(f"config file {path}: {key} must be {' or '.join(names)}, got {value!r}")


def build_config(args: argparse.Namespace):
    from slide_hf.recipe import TrainConfig

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    values: dict[str, Any] = {}
    if args.config is not None:
        for key, value in _from_toml(args.config).items():
            if key not in fields:
                raise UserError(f"config file {args.config}: unknown option {key!r}")
            _check_toml_value(args.config, key, value, fields[key].type)
            values[key] = value
    for name in fields:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    for name in ("data", "output", "metrics", "resume", "nvme_dir"):
        if isinstance(values.get(name), str):
            values[name] = Path(values[name])
    try:
        return TrainConfig(**values)
    except TypeError as error:
        raise UserError(f"bad option value: {error}") from None


def run(args: argparse.Namespace) -> int:
    from slide_hf.recipe import train

    summary = train(build_config(args))
    print(f"trained {summary.steps} steps: loss {summary.first_loss:.4f} -> {summary.last_loss:.4f}")
    print(f"model written to {summary.model_dir}")
    return 0
