"""slide_hf/launch.py: `slide train --nproc-per-node N` becomes torch's launcher of N copies of the same
command (as `torchrun --standalone --nproc-per-node N -m slide_hf train ...`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slide_core.checkpoint import read_state
from slide_hf.errors import UserError
from slide_hf.launch import (
    SHUTDOWN_GRACE_S,
    THREAD_VARIABLES,
    check_gpus_for_ranks,
    launch_environment,
    launcher_command,
    share_host_cores,
)

LAUNCHER = [sys.executable, "-m", "slide_hf.launch", "--standalone"]


@pytest.mark.parametrize("flag", [["--nproc-per-node", "3"], ["--nproc-per-node=3"]])
def test_the_command_is_the_same_without_the_flag(flag: list[str]) -> None:
    argv = ["-v", "train", "--steps", "2", *flag, "--output", "runs/x"]
    assert launcher_command(3, argv, environ={}) == [
        *LAUNCHER,
        "--nproc-per-node=3",
        "-m",
        "slide_hf",
        "-v",
        "train",
        "--steps",
        "2",
        "--output",
        "runs/x",
    ]


def test_one_process_or_a_launched_one_is_one_line() -> None:
    with pytest.raises(UserError, match="--nproc-per-node must be >= 2 to launch several processes, got 1"):
        launcher_command(1, ["train"], environ={})
    with pytest.raises(UserError, match="WORLD_SIZE=2 already set: this process was started by a launcher"):
        launcher_command(2, ["train"], environ={"WORLD_SIZE": "2"})


def test_more_gpu_ranks_than_gpus_is_one_line(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_gpus_for_ranks("auto", 2)
    check_gpus_for_ranks("cpu", 8)  # gloo ranks on the CPU
    with pytest.raises(UserError) as info:
        check_gpus_for_ranks("cuda", 4)
    assert str(info.value) == (
        "--nproc-per-node 4 runs one process per GPU, but torch sees 2 GPU(s) here; use --nproc-per-node 2 or "
        "fewer (or --device cpu)"
    )


def test_each_rank_gets_its_share_of_the_cores_unless_the_user_set_it() -> None:
    cores = len(os.sched_getaffinity(0))
    environ: dict[str, str] = {}
    assert share_host_cores(2, environ) == max(1, cores // 2)
    assert environ == dict.fromkeys(THREAD_VARIABLES, str(max(1, cores // 2)))
    environ = {"OMP_NUM_THREADS": "3"}
    share_host_cores(10 * cores, environ)
    assert environ == {"OMP_NUM_THREADS": "3", "NUMBA_NUM_THREADS": "1"}  # the user's value stays; at least one


@pytest.mark.parametrize(("cores", "ranks", "share"), [(16, 1, 14), (16, 2, 7), (8, 1, 6), (4, 1, 4), (2, 1, 2)])
def test_a_large_host_keeps_cores_for_the_launching_and_transfer_threads(monkeypatch, cores, ranks, share) -> None:
    """Note [Host cores per rank]: from 8 cores up, RESERVED_CORES stay out of the optimizer's share (one
    process or several); a small host gives the optimizer every core."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    environ: dict[str, str] = {}
    assert share_host_cores(ranks, environ) == share
    assert environ == dict.fromkeys(THREAD_VARIABLES, str(share))


def test_one_run_shares_the_cores_then_leaves_the_environment_as_it_was(monkeypatch) -> None:
    """A run from Python (Note [Host cores per rank]) sets the thread variables only while it runs: processes
    started after it (ranks of a later launch) get their own share, not this run's."""
    from slide_hf.launch import host_cores_for_this_run

    for name in THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with host_cores_for_this_run() as share:
        assert os.environ["NUMBA_NUM_THREADS"] == str(share) and os.environ["OMP_NUM_THREADS"] == "3"
    assert "NUMBA_NUM_THREADS" not in os.environ and os.environ["OMP_NUM_THREADS"] == "3"


def test_the_launcher_gives_the_ranks_time_to_checkpoint(monkeypatch) -> None:
    """Torch's launcher reads the grace period before SIGKILL from TORCH_ELASTIC_SHUTDOWN_TIMEOUT: 30 s by
    default, too short for a large model's checkpoint shards (Note [Time to stop]); the user's value stays."""
    from torch.distributed.launcher.api import LaunchConfig

    environ: dict[str, str] = {}
    launch_environment(2, environ)
    assert environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(SHUTDOWN_GRACE_S)
    assert set(THREAD_VARIABLES) <= set(environ)
    environ = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}
    launch_environment(2, environ)
    assert environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "90"
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:  # this torch's launcher has the setting
        monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE_S))
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2)
        assert config.shutdown_timeout == SHUTDOWN_GRACE_S


@pytest.mark.slow
def test_slide_train_launches_its_ranks(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, "-m", "slide_hf", "train", "--model", "tiny-llama", "--device", "cpu", "--dtype"]
    command += ["float32", "--seq-len", "32", "--steps", "2", "--batch-size", "1", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, "--output", str(run)], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = read_state(run / "checkpoints" / "step-00000002")
    assert manifest["world_size"] == 2
    assert (run / "model" / "model.safetensors").is_file()
    # rank 0 alone reports the run: one summary and one progress line per step, not one per process;
    # the ranks share the host's cores (Note [Host cores per rank])
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"host threads per rank: {share} (2 ranks on this host)" in done.stderr, done.stderr[-3000:]
    assert done.stdout.count("trained 2 steps") == 1, done.stdout
    assert done.stderr.count("step 2/2") == 1, done.stderr[-3000:]


def test_the_launch_reports_the_rank_that_stopped_first_for_its_own_reason() -> None:
    """Rank 1 may exit (status PEER_STOPPED_STATUS: its collective broke) as early as rank 0, whose error
    stopped the run: the line names rank 0 whatever the order the launcher saw them in."""
    from types import SimpleNamespace

    from slide_hf.launch import PEER_STOPPED_STATUS, first_cause

    failures = {
        1: SimpleNamespace(exitcode=PEER_STOPPED_STATUS, timestamp=100),
        0: SimpleNamespace(exitcode=2, timestamp=100),
    }
    assert first_cause(failures)[0] == 0
    failures[0].timestamp = 101  # noticed later, still the cause
    assert first_cause(failures)[0] == 0
    only_peers = {2: SimpleNamespace(exitcode=PEER_STOPPED_STATUS, timestamp=5), 1: failures[1]}
    assert first_cause(only_peers)[0] == 2  # the earliest when every rank only saw another go
    killed = {0: SimpleNamespace(exitcode=-9, timestamp=7), 1: SimpleNamespace(exitcode=1, timestamp=3)}
    assert first_cause(killed)[0] == 1


_RANK_THAT_FAILS = """
import os, signal, sys
from slide_hf.launch import failure_outlives_peers
fails = sys.argv[1] == "1"
try:
    with failure_outlives_peers():
        if fails:
            raise FileNotFoundError("its own reason")
except FileNotFoundError:
    pass
os.kill(os.getpid(), signal.SIGTERM)  # the launcher stopping the others, while this rank is on its way out
sys.exit(2)
"""


@pytest.mark.parametrize(
    ("fails", "launched", "returncode"),
    [
        (True, True, 2),  # a launched rank leaving on its own failure keeps its status
        (False, True, -15),  # a rank that did not fail stays stoppable
        (True, False, -15),  # not started by torch's launcher
    ],
)
def test_a_failing_rank_is_not_turned_into_one_killed_by_the_launcher(
    fails: bool, launched: bool, returncode: int
) -> None:
    """Note [A failing rank keeps its status]: the SIGTERM the launcher sends every rank when another
    exits does not replace the status of a rank already leaving with its own failure."""
    env = {key: value for key, value in os.environ.items() if key != "TORCHELASTIC_RUN_ID"}
    if launched:
        env["TORCHELASTIC_RUN_ID"] = "test"
    command = [sys.executable, "-c", _RANK_THAT_FAILS, str(int(fails))]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == returncode, done.stderr[-2000:]


@pytest.mark.slow
def test_a_failing_rank_ends_the_launch_in_one_line(tmp_path: Path) -> None:
    """Each rank says what stopped it (rank 0: the missing file; rank 1: that rank 0 stopped, not a bug);
    the launcher ends with one line naming the rank and exits with its status; no traceback.

    Rank 0 is made slow to exit (2 s in an ``atexit``), so the launcher always stops it while it is on its
    way out: the race of Note [A failing rank keeps its status], every time rather than under load."""
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    slow_exit = tmp_path / "slow_exit"
    slow_exit.mkdir()
    (slow_exit / "sitecustomize.py").write_text(
        "import atexit, os, time\nif os.environ.get('RANK') == '0':\n    atexit.register(time.sleep, 2)\n"
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(slow_exit), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "slide_hf", "train", "--model", "tiny-llama", "--device", "cpu", "--steps", "1"]
    command += ["--nproc-per-node", "2", "--data", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "run")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("slide train:")]
    assert f"slide train: error: data file {tmp_path / 'missing.jsonl'} does not exist" in lines
    assert lines[-1] == "slide train: rank 0 exited with status 2; every rank was stopped"
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr and "bug" not in done.stderr


@pytest.mark.parametrize("command", ["train", "plan"])
def test_int8_state_under_data_parallel_is_one_line_before_anything_starts(command: str, capsys) -> None:
    from slide_hf.cli.main import main

    argv = [command, "--model", "tiny-llama", "--device", "cpu", "--optimizer-state", "int8"]
    assert main([*argv, "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"slide {command}: error: --optimizer-state int8 does not run with data parallel (2 processes) yet: a "
        "rank's shard could split one of its 64-element blocks; use --optimizer-state bf16 or fp32"
    )


def test_more_cpu_ranks_than_cores_is_one_line(monkeypatch, capsys) -> None:
    import torch

    from slide_hf.cli.main import main
    from slide_hf.launch import check_ranks_for_cores

    cores = os.cpu_count() or 1
    assert main(["train", "--device", "cpu", "--nproc-per-node", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"slide train: error: --nproc-per-node 100000 runs one training process per rank, but this host has "
        f"{cores} CPU core(s); use --nproc-per-node {cores} or fewer"
    ]
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    check_ranks_for_cores("cpu", 4)
    with pytest.raises(UserError, match="--nproc-per-node 5 runs one training process per rank, but this host has 4"):
        check_ranks_for_cores("cpu", 5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--nproc-per-node 5 runs"):
        check_ranks_for_cores("auto", 5)  # auto without a GPU runs on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_ranks_for_cores("cuda", 5)  # GPU ranks are bounded by the GPUs instead


_ORPHAN = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "launcher":  # a launcher: starts its rank in a session of its own, as torch's does
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[2], "rank"], start_new_session=True, env={**os.environ, "TORCHELASTIC_RUN_ID": "x"})
    print(rank.pid, flush=True)
    time.sleep(60)
else:  # the rank: asks for the signal, then says which signal ended it
    from slide_hf.launch import stop_with_launcher
    signal.signal(signal.SIGTERM, lambda number, frame: (open(os.environ["MARK"], "w").write("SIGTERM"), os._exit(0)))
    assert stop_with_launcher()
    time.sleep(60)
"""


def test_a_rank_stops_when_its_launcher_is_killed(tmp_path: Path) -> None:
    """Note [A rank outlives no launcher]: SIGKILL the launcher and its rank, in a session of its own so no
    group signal reaches it, gets SIGTERM (which a real rank answers by checkpointing with the others)."""
    import signal
    import time

    mark = tmp_path / "mark"
    launcher = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN, "launcher", _ORPHAN],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "MARK": str(mark)},
    )
    assert launcher.stdout is not None
    rank_pid = int(launcher.stdout.readline())
    try:
        time.sleep(3)  # the rank imports slide_hf and asks
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 20
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mark.read_text() == "SIGTERM"
        assert _gone_within(rank_pid, 10)  # nothing left behind
    finally:
        launcher.kill()
        if not _gone_within(rank_pid, 0):
            os.kill(rank_pid, signal.SIGKILL)


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether ``pid`` has exited (or is a zombie nobody reaped yet) within ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def test_only_a_launched_rank_asks_to_stop_with_its_launcher() -> None:
    from slide_hf.launch import stop_with_launcher

    assert not stop_with_launcher(environ={})
