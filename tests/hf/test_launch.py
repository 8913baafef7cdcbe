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
from slide_hf.launch import launcher_command

LAUNCHER = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


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
    assert manifest["extra"]["world_size"] == 2
    assert (run / "model" / "model.safetensors").is_file()
