"""`slide train --nproc-per-node N`: data parallel on this host without typing torchrun.

The process replaces itself (``os.execv``) with ``python -m slide_hf.launch --standalone --nproc-per-node N
-m slide_hf <the same command line without --nproc-per-node>``: torch's launcher (``torch.distributed.run``,
what ``torchrun --nproc-per-node N -m slide_hf train ...`` runs, docs/distributed.md) in this process, by
:func:`main`. Replacing rather than wrapping in a child means a SIGINT/SIGTERM sent to the command reaches
torch's launcher itself, which passes it to every rank (each then checkpoints, Note [Stop on every rank]
in recipe.py). Where torch's launcher would end with its own traceback and failure report, :func:`main`
ends with one line naming the first rank that failed and how (each rank has already printed its own
error), and exits with that rank's status. Several hosts still need torchrun on each (``--nnodes``,
``--node-rank``, the rendezvous address), which this convenience does not guess.

Note [Time to stop]: on SIGINT/SIGTERM torch's launcher passes the signal to every rank and SIGKILLs those
still running after ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds, 30 by default. A rank that gets the signal
finishes its step and writes its checkpoint shards (Note [Stop on every rank] in recipe.py), which for a
large model takes minutes: killed at 30 s it would lose every step since the previous checkpoint. The
ranks this command launches get :data:`SHUTDOWN_GRACE_S` unless the variable is set. Under torchrun itself,
pass ``--shutdown-timeout`` (or set the variable) the same way (docs/distributed.md).

Note [Host cores per rank]: every rank runs its own host optimizer, whose numba kernels would each take
every core of the host: N ranks would run N times as many threads as there are cores, all at once in the
backward. So each rank gets the host's usable cores divided by the ranks on the host, through
``NUMBA_NUM_THREADS`` (the kernels) and ``OMP_NUM_THREADS`` (torch's own CPU ops; torch's launcher would
otherwise set it to 1), wherever the user has not set them: here for the ranks this command launches, and
in each rank (slide_hf/recipe.py) for ranks started by torchrun itself, where only ``NUMBA_NUM_THREADS``
is still free. A single process gets the same treatment (slide_hf/recipe.py, slide_hf/bench.py). On a host of 8 cores or
more, :data:`RESERVED_CORES` stay out of the share: the optimizer is bound by host memory bandwidth, which
8 of 16 threads already saturate, while a main thread starved of a core launches the GPU's kernels late
and stretches every block's compute.

Note [A failing rank keeps its status]: a rank that stops for its own reason (a missing data file) closes
its connections as it leaves its process groups; the other ranks' next collective fails at once and they
exit with :data:`PEER_STOPPED_STATUS`; torch's launcher, seeing the first of them exit, SIGTERMs every rank
still running, including the failing one, which may still be on its way out (printing its error, the
interpreter's shutdown). Killed there, it is reported as "killed by SIGTERM" and its own status is lost,
so the launch would end naming the wrong cause. A launched rank that leaves its groups on an exception
therefore ignores SIGTERM from then on (:func:`failure_outlives_peers`): it is already exiting, and the
launcher's SIGKILL after the shutdown timeout still bounds the wait.

Note [A rank outlives no launcher]: torch's launcher starts each rank in a session of its own, so a signal
to the command's process group does not reach the ranks past it, and when the launcher itself is killed
(SIGKILL, an out-of-memory kill, a closed terminal's SIGHUP it does not pass on) nothing stops them: they
would train on, unseen, holding the GPU, the run directory's lock and the host's memory, until their next
collective with a rank that also lost its way. So a launched rank asks the kernel (Linux's
``PR_SET_PDEATHSIG``) for a SIGTERM when its parent, the launcher, exits: the same signal the launcher
would have passed on, so the ranks stop together after their step and write their checkpoint (Note [Stop on
every rank] in recipe.py). A rank whose launcher was already gone when it asked stops the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

from slide_hf.errors import UserError, say

__all__ = [
    "PEER_STOPPED_STATUS",
    "RESERVED_CORES",
    "SHUTDOWN_GRACE_S",
    "THREAD_VARIABLES",
    "check_gpus_for_ranks",
    "failure_outlives_peers",
    "first_cause",
    "host_cores_for_this_run",
    "launch_environment",
    "launcher_command",
    "main",
    "relaunch",
    "share_host_cores",
    "stop_with_launcher",
]

FLAG = "--nproc-per-node"
SHUTDOWN_GRACE_S = 1800
"""How long torch's launcher lets the ranks checkpoint after a stop signal (Note [Time to stop])."""
RESERVED_CORES = 2
"""Cores left out of the host optimizer's share on a host of 8 or more (Note [Host cores per rank]): the
thread that launches the GPU's kernels and the transfer threads need a core each while the optimizer runs."""
PEER_STOPPED_STATUS = 3
"""A rank's exit status when a collective failed because another rank stopped or did not answer: the launcher
reports the rank that stopped first for its own reason, not one that only saw it go (they can finish in
either order)."""
THREAD_VARIABLES = ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")
"""How many threads torch's CPU ops and the numba kernels start (Note [Host cores per rank])."""


def share_host_cores(ranks_on_host: int, environ: MutableMapping[str, str]) -> int:
    """Set each of :data:`THREAD_VARIABLES` that ``environ`` lacks to one rank's share of the usable cores
    (at least one) and return that share (Note [Host cores per rank])."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    usable = cores - RESERVED_CORES if cores >= 4 * RESERVED_CORES else cores
    share = max(1, usable // max(1, ranks_on_host))
    for name in THREAD_VARIABLES:
        if not environ.get(name):
            environ[name] = str(share)
    return share


@contextlib.contextmanager
def host_cores_for_this_run(ranks_on_host: int = 1) -> Iterator[int]:
    """One rank's share of the host (:func:`share_host_cores`) while the block runs, then
    the environment as it was: a run started from Python (a notebook, a test) must not leave the variables
    behind for the processes it starts later (Note [Host cores per rank]). numba reads them when first
    imported, so the share holds for this process's kernels from then on."""
    saved = {name: os.environ.get(name) for name in THREAD_VARIABLES}
    try:
        yield share_host_cores(ranks_on_host, os.environ)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
    launcher = [sys.executable, "-m", "slide_hf.launch", "--standalone", f"{FLAG}={nproc_per_node}"]
    return [*launcher, "-m", "slide_hf", *rest]


def check_ranks_for_cores(device: str, nproc_per_node: int) -> None:
    """Refuse, in one line, more ranks on the CPU (``--device cpu``, or ``auto`` without a GPU) than the
    host has cores (``os.cpu_count()``): each rank is a whole training process with its own optimizer
    threads, so more than one per core only thrashes (and thousands exhaust the host before any error)."""
    import torch

    if device != "cpu" and (device != "auto" or torch.cuda.is_available()):
        return
    cores = os.cpu_count() or 1
    if nproc_per_node > cores:
        raise UserError(
            f"{FLAG} {nproc_per_node} runs one training process per rank, but this host has {cores} CPU core(s); "
            f"use {FLAG} {cores} or fewer"
        )


def check_gpus_for_ranks(device: str, nproc_per_node: int) -> None:
    """Refuse, in one line, more GPU ranks than GPUs: every rank this command launches sees the same GPUs
    and takes the one of its local rank (``ProcessGroupContext.device_index``), so two would share one and
    NCCL would fail at its first collective. ``--device cpu`` (gloo) has no such limit."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if nproc_per_node > gpus:
        raise UserError(
            f"{FLAG} {nproc_per_node} runs one process per GPU, but torch sees {gpus} GPU(s) here; "
            f"use {FLAG} {gpus} or fewer (or --device cpu)"
        )


def launch_environment(nproc_per_node: int, environ: MutableMapping[str, str]) -> None:
    """What the launcher and its ranks inherit, set where the user has not: each rank's share of the host's
    cores (Note [Host cores per rank]) and the time the ranks get to checkpoint on a stop signal (Note [Time
    to stop])."""
    share_host_cores(nproc_per_node, environ)
    if not environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(SHUTDOWN_GRACE_S)


def relaunch(nproc_per_node: int, argv: Sequence[str]) -> int:
    """Replace this process with :func:`launcher_command`'s; returns only when that cannot start."""
    command = launcher_command(nproc_per_node, argv)
    launch_environment(nproc_per_node, os.environ)  # inherited by the launcher and its ranks
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(command[0], command)
    except OSError as error:
        raise UserError(f"cannot start {' '.join(command[:4])}: {error.strerror or error}") from None
    return 1  # not reached: execv replaced the process


def main(argv: Sequence[str]) -> int:
    """Torch's launcher on ``argv`` (its own arguments); a failed rank is one line and its exit status.

    The launcher's own log lines (which processes it signals, a failure report per rank) are silenced: the
    ranks have printed their errors, and the line here says which one failed first."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        torchrun.main(list(argv))
    except ChildFailedError as error:
        rank, failure = first_cause(error.failures)
        code = failure.exitcode
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        say(f"slide train: rank {rank} {how}; every rank was stopped")
        return 128 - code if code < 0 else code or 1
    except SignalException as error:
        say(f"slide train: stopped by {_signal_name(error.sigval)}")
        return 128 + int(error.sigval)
    return 0


_PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal this process gets when its parent exits."""


def stop_with_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """In a rank that torch's launcher started (``TORCHELASTIC_RUN_ID`` set), on Linux: a SIGTERM when the
    launcher exits (Note [A rank outlives no launcher]). Returns whether it was asked for."""
    env = os.environ if environ is None else environ
    if not env.get("TORCHELASTIC_RUN_ID") or not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        asked = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        asked = False
    if not asked:
        logging.getLogger("slide.train").warning(
            "cannot ask to stop with the launcher (prctl); a killed launcher leaves this rank running"
        )
        return False
    if parent == 1 or os.getppid() != parent:  # the launcher was gone already (this rank was re-parented)
        os.kill(os.getpid(), signal.SIGTERM)
    return True


@contextlib.contextmanager
def failure_outlives_peers(environ: Mapping[str, str] | None = None) -> Iterator[None]:
    """Around the work of a rank that torch's launcher started (``TORCHELASTIC_RUN_ID`` set): when the work
    raises, SIGTERM is ignored from then on, before the rank's groups close, so the rank exits with its own
    status (Note [A failing rank keeps its status]). Nothing changes on success, in a process no launcher
    started, or off the main thread (where no signal handler can be set). A launch of one process has no
    peers to outlive, and its exit is the same either way."""
    env = os.environ if environ is None else environ
    try:
        yield
    except BaseException:
        if env.get("TORCHELASTIC_RUN_ID") and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise


def first_cause(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failed rank to report: the earliest (then lowest) that did not stop only because another rank did
    (:data:`PEER_STOPPED_STATUS`); the earliest of all when every rank says so."""
    ordered = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    own = [item for item in ordered if item[1].exitcode != PEER_STOPPED_STATUS]
    return (own or ordered)[0]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
