"""`slide`: the top-level parser. Each command lives in its own module with ``add_parser`` and ``run``.

User errors (a bad path, an unknown preset, a malformed data line) are :class:`UserError`s: they print one
line naming the bad thing and exit with status 2, without a traceback.

The commands run with PyTorch's expandable-segments CUDA allocator unless ``PYTORCH_CUDA_ALLOC_CONF`` is
already set: under a ``--gpu-memory`` cap the default allocator's cached, partly used blocks can refuse a
256 MiB loss chunk with a gigabyte free in pieces (seen at 12 GiB on a 3B model); growable segments
do not fragment that way.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from slide_hf.errors import UserError

COMMANDS = ("train", "plan", "bench", "doctor", "export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slide",
        description="Full-parameter fine-tuning of LLMs larger than the GPU, one sliding window of layers at a time.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"slide_hf.cli.{name}").add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # read at the first CUDA allocation
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(f"slide_hf.cli.{args.command}")
    try:
        return int(module.run(args) or 0)
    except UserError as error:
        print(f"slide {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"slide {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
