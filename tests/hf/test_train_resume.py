"""Checkpoint and resume through `slide train`: bit-identical continuation, kill -9 safety, corruption."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from slide_hf.errors import UserError
from slide_hf.recipe import TrainConfig, train


@pytest.fixture(autouse=True)
def _torch_loss(monkeypatch):
    """A CPU user's run takes the torch fallback of the fused loss; the Triton interpreter that the kernel
    tests turn on would make these end-to-end runs minutes long."""
    monkeypatch.setenv("SLIDE_KERNELS_BACKEND", "torch")


def _config(output: Path, **overrides) -> TrainConfig:
    base = dict(
        output=output,
        device="cpu",
        dtype="float32",
        steps=8,
        seq_len=32,
        batch_size=2,
        grad_accum=2,
        lr=3e-3,
        weight_decay=0.01,
        lr_schedule="cosine",
        warmup_steps=2,
        seed=3,
        metrics=output / "metrics.jsonl",
    )
    base.update(overrides)
    return TrainConfig(**base)


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05])
def test_resume_after_4_of_8_steps_is_bit_identical(tmp_path: Path, max_grad_norm: float) -> None:
    """With clipping that triggers, the checkpoint also carries whether the next step defers its host
    updates (Note [Deferred clipped steps]), which decides their rounding."""
    full = train(_config(tmp_path / "full", save_every=4, max_grad_norm=max_grad_norm))
    if max_grad_norm:
        norms = [json.loads(line)["grad_norm"] for line in (tmp_path / "full/metrics.jsonl").read_text().splitlines()]
        assert all(norm > max_grad_norm for norm in norms), "test setup: every step must clip"
    # Interrupted run: the same job, resumed from its step-4 checkpoint in a fresh output directory.
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full/checkpoints/step-00000004", resumed_dir / "checkpoints/step-00000004")
    resumed = train(_config(resumed_dir, resume=resumed_dir, max_grad_norm=max_grad_norm))
    assert resumed.steps == 4
    assert _losses(resumed_dir / "metrics.jsonl") == _losses(tmp_path / "full/metrics.jsonl")[4:]
    want, got = _weights(full.model_dir), _weights(resumed.model_dir)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


def test_corrupt_checkpoint_is_named(tmp_path: Path) -> None:
    train(_config(tmp_path / "run", steps=2, save_every=2))
    master = tmp_path / "run/checkpoints/step-00000002/master.bin"
    data = bytearray(master.read_bytes())
    data[len(data) // 2] ^= 0xFF
    master.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"master\.bin fails its checksum"):
        train(_config(tmp_path / "again", steps=4, resume=tmp_path / "run"))
    master.write_bytes(bytes(data[:100]))
    with pytest.raises(UserError, match="truncated"):
        train(_config(tmp_path / "again2", steps=4, resume=tmp_path / "run"))


@pytest.mark.slow  # a fresh Python process: seconds of imports
@pytest.mark.timeout(120)
def test_kill_9_during_a_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    output = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        import slide_core.checkpoint as ckpt
        from slide_hf.recipe import TrainConfig, train
        original = ckpt._write_source  # every array streams (Engine.checkpoint_arrays)
        calls = []
        def slow_write(path, *args):
            calls.append(path)
            if "step-00000004" in str(path):
                Path({str(tmp_path / "saving")!r}).touch()
                time.sleep(60)  # killed here, mid-save
            return original(path, *args)
        ckpt._write_source = slow_write
        train(TrainConfig(output=Path({str(output)!r}), device="cpu", dtype="float32", steps=6, seq_len=32,
                          batch_size=2, save_every=2, lr=3e-3))
        """
    )
    env = {**os.environ, "SLIDE_KERNELS_BACKEND": "torch"}
    process = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 90
    while not (tmp_path / "saving").exists():
        assert process.poll() is None, "training exited before the save under test"
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    from slide_core.checkpoint import find_latest

    assert find_latest(output).name == "step-00000002"
    resumed = train(
        _config(
            tmp_path / "resumed",
            steps=6,
            grad_accum=1,
            lr=3e-3,
            lr_schedule="linear",
            warmup_steps=0,
            weight_decay=0.0,
            seed=0,
            resume=output,
        )
    )
    assert resumed.steps == 4
