"""`slide train --nproc-per-node N`: data parallel on this host without typing torchrun.

The process replaces itself (``os.execv``) with ``python -m torch.distributed.run --standalone
--nproc-per-node N -m slide_hf <the same command line without --nproc-per-node>``, which is exactly what
``torchrun --nproc-per-node N -m slide_hf train ...`` runs (docs/distributed.md). Replacing rather than
wrapping means a SIGINT/SIGTERM sent to the command reaches torch's launcher itself, which passes it to
every rank (each then checkpoints, Note [Stop on every rank] in recipe.py), and the command's exit status
is the launcher's. Several hosts still need torchrun on each (``--nnodes``, ``--node-rank``, the
rendezvous address), which this convenience does not guess.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from slide_hf.errors import UserError

__all__ = ["launcher_command", "relaunch"]

FLAG = "--nproc-per-node"


def launcher_command(nproc_per_node: int, argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The command that runs ``argv`` (``slide``'s arguments, ``train`` and its options) in
    ``nproc_per_node`` processes; a count below 2, or a process already started by a launcher, is one
    line."""
    env = os.environ if environ is None else environ
    if nproc_per_node < 2:
        raise UserError(f"{FLAG} must be >= 2 to launch several processes, got {nproc_per_node}")
    if env.get("WORLD_SIZE"):
        raise UserError(
            f"{FLAG} with WORLD_SIZE={env['WORLD_SIZE']} already set: this process was started by a launcher"
        )
    rest: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == FLAG:
            skip = True
        elif not arg.startswith(f"{FLAG}="):
            rest.append(arg)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"{FLAG}={nproc_per_node}"]
    return [*launcher, "-m", "slide_hf", *rest]


def relaunch(nproc_per_node: int, argv: Sequence[str]) -> int:
    """Replace this process with :func:`launcher_command`'s; returns only when that cannot start."""
    command = launcher_command(nproc_per_node, argv)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(command[0], command)
    except OSError as error:
        raise UserError(f"cannot start {' '.join(command[:4])}: {error.strerror or error}") from None
    return 1  # not reached: execv replaced the process
