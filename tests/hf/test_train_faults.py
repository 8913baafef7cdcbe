"""Faults during `slide train`: a CUDA OOM gives one clear line, nothing hangs, the last checkpoint stays."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from slide_core.checkpoint import find_latest, list_checkpoints
from slide_hf.cli.main import main


@pytest.fixture(autouse=True)
def _torch_loss(monkeypatch):
    """A CPU user's run takes the torch fallback of the fused loss (not the Triton interpreter)."""
    monkeypatch.setenv("SLIDE_KERNELS_BACKEND", "torch")


@pytest.mark.timeout(120)
def test_oom_names_the_allocation_and_the_plan_command(tmp_path: Path, monkeypatch, capsys) -> None:
    from slide_hf.adapters import base

    calls = {"n": 0}
    original = base.BlockUnit.forward

    def forward(self, params, x, inputs):
        calls["n"] += 1
        if calls["n"] > 40:  # a few steps in, after the first checkpoint
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.5 GiB"
            )
        return original(self, params, x, inputs)

    monkeypatch.setattr(base.BlockUnit, "forward", forward)
    output = tmp_path / "run"
    before = {t for t in threading.enumerate() if t.name.startswith("slide-")}
    began = time.monotonic()
    code = main(["train", "--output", str(output), "--steps", "6", "--seq-len", "32", "--save-every", "2"])
    assert code == 2
    assert time.monotonic() - began < 60
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert "GPU out of memory in step" in err[0] and "Tried to allocate 2.00 GiB" in err[0]
    assert "slide plan --model tiny-llama --batch-size 4 --seq-len 32" in err[0]
    assert list_checkpoints(output / "checkpoints"), "the checkpoint written before the fault is gone"
    assert find_latest(output).name.startswith("step-")
    time.sleep(0.5)
    left = {t for t in threading.enumerate() if t.name.startswith("slide-") and t.is_alive()} - before
    assert not left, f"threads left behind: {left}"
