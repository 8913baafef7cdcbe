"""`slide`: the top-level parser. Each command lives in its own module with ``add_parser`` and ``run``.

Exit status and what is printed on stderr, one line each, never a traceback unless ``-v``:

- 0: success.
- 2: bad input -- a :class:`UserError` (a bad path, an unknown preset, a malformed data line, a full
  disk) or an unreadable command line -- printed as ``slide CMD: error: ...``.
- 130 / 143: a run stopped by SIGINT / SIGTERM after saving a checkpoint (:class:`RunStopped`); the line
  gives the command that continues it and is not an error. A bare Ctrl-C elsewhere is 130 too, and a second
  signal that ends a run at once is 128 + its number (143 for SIGTERM, 130 for SIGINT).
- 2 as well when the GPU runs out of memory anyway (a ``torch.OutOfMemoryError`` anywhere in the
  exception's chain, also wrapped by the engine's worker threads): the plan priced the run within the
  budget and it did not hold, so the line says so, gives the budget and what to try.
- 1 for a CUDA error raised inside another package's kernel (flash-linear-attention, flash-attn): the
  line names the package and its version and how to run without it (cli/kernel_fault.py).
- 1: anything else is a bug in slide: one line with the exception and where to report it; ``-v``
  prints the traceback.

The commands run with PyTorch's expandable-segments CUDA allocator unless ``PYTORCH_CUDA_ALLOC_CONF`` is
already set: under a ``--gpu-memory`` cap the default allocator's cached, partly used blocks can refuse a
256 MiB loss chunk with a gigabyte free in pieces (seen at 12 GiB on a 3B model); growable segments
do not fragment that way.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from typing import NoReturn

from slide_hf.cli.kernel_fault import third_party_fault
from slide_hf.errors import Interrupted, RunStopped, UserError, say
from slide_hf.launch import PEER_STOPPED_STATUS

COMMANDS = ("train", "data", "plan", "bench", "doctor", "export")


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage block before a bad option's message; one line names the problem and
    where the usage is. Subcommand parsers are built from the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="slide",
        description="Full-parameter fine-tuning of LLMs larger than the GPU, one sliding window of layers at a time.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"slide_hf.cli.{name}").add_parser(commands)
    return parser


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM ends a command as Ctrl-C does: raised as :class:`Interrupted` (a ``KeyboardInterrupt``), so
    the cleanup written for Ctrl-C runs (a tokenization's temporary files, a half-written cache entry) and
    the command prints one line and exits 143, where the default action killed the process silently
    (a scheduler's notice while a large data set was tokenized, before the run's own handlers,
    slide_hf/recipe.py's ``_StopRequests``, take over; they restore this one when they leave). Only in the
    main thread, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted("SIGTERM", 128 + signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:  # unless the command set its own on the way out (a failing rank ignores the launcher's SIGTERM,
        # Note [A failing rank keeps its status] in slide_hf/launch.py)
        if signal.getsignal(signal.SIGTERM) is interrupt:
            signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # read at the first CUDA allocation
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a command line argparse refused (one line, above)
        return exit_.code if isinstance(exit_.code, int) else 2
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a command may hand on (slide_hf/launch.py)
    level = logging.DEBUG if args.verbose else logging.INFO if _is_main_rank() else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(f"slide_hf.cli.{args.command}")
    try:
        with _terminate_as_interrupt():
            return int(module.run(args) or 0)
    except UserError as error:
        say(f"slide {args.command}: error: {_one_line(error)}")
        return 2
    except RunStopped as stop:  # every rank stops together and says the same: rank 0 says it once
        if _is_main_rank():
            say(f"slide {args.command}: {_one_line(stop)}")
        return stop.exit_code
    except Interrupted as interrupted:  # a second SIGINT/SIGTERM during a run (slide_hf/recipe.py)
        say(f"slide {args.command}: interrupted by {interrupted.signal_name}")
        return interrupted.exit_code
    except KeyboardInterrupt:
        say(f"slide {args.command}: interrupted")
        return 130
    except Exception as error:
        if args.verbose:
            traceback.print_exc()
        if _out_of_memory(error):
            say(f"slide {args.command}: error: {_out_of_memory_line(args)}")
            return 2
        collective = _in_chain(error, "CollectiveError")
        if collective is not None:  # another rank stopped (its own line says why) or did not answer
            say(f"slide {args.command}: error: {_one_line(collective)}")
            return PEER_STOPPED_STATUS
        fault = third_party_fault(error)
        if fault is not None:
            say(f"slide {args.command}: error: {fault}")
            return 1
        say(
            f"slide {args.command}: internal error: {type(error).__name__}: {_one_line(error)} -- this is a bug in "
            f"slide; please report it with the output of `slide -v {args.command} ...`"
        )
        return 1


def _out_of_memory(error: BaseException) -> bool:
    """Whether a ``torch.OutOfMemoryError`` is ``error`` or anywhere in its cause/context chain."""
    return _in_chain(error, "OutOfMemoryError") is not None


def _in_chain(error: BaseException, name: str) -> BaseException | None:
    """The first exception of class ``name`` in ``error``'s cause/context chain (the engine re-raises a
    worker thread's failure as an ``EngineError`` whose cause is the original), or None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if type(current).__name__ == name:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _is_main_rank() -> bool:
    """Whether this process is the one that reports progress: rank 0 of a data-parallel run (torchrun's
    ``RANK``), or the only process. The other ranks log warnings and errors only, so the console shows
    one run, not one per process."""
    try:
        return int(os.environ.get("RANK") or 0) == 0
    except ValueError:
        return True


def _out_of_memory_line(args: argparse.Namespace) -> str:
    """The GPU ran out beyond the plan: the budget the run was planned within, and what to try."""
    cap = getattr(args, "gpu_memory", None)
    if cap is not None:
        from slide_hf.sizes import format_bytes, parse_size

        budget = f"{format_bytes(parse_size(cap, what='--gpu-memory'))} allowed by --gpu-memory"
        larger = "a larger --gpu-memory"
    else:
        budget = "the whole GPU"
        larger = "a GPU with more memory"
    return f"the GPU ran out of memory beyond the plan ({budget}); try a smaller --batch-size or --seq-len, or {larger}"


def _one_line(error: BaseException) -> str:
    """The message on one line: the first non-empty line, or the exception's type when it has none."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
