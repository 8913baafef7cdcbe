"""`slide train --objective dpo|simpo` in 2 real gloo processes (docs/preference.md, "Data parallel"): the ranks
train, log and evaluate what one process does at the same global batch, share DPO's reference pass (Note
[The ranks share the reference pass] in slide_hf/preference/reference.py), and a resume of 2 ranks reads
that pass and continues bit for bit.

tiny-llama with the bundled byte tokenizer, fp32 on the CPU device, one pair a row: 2 ranks with 1 row per
micro-batch against one process with 2, both accumulating 2 micro-batches over 3 steps, and 5 held-out
pairs evaluated at steps 2 and 3 (an odd count: rank 1 evaluates a filler beside its 2 micro-batches).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from slide_core.testing import launch_ranks, wait_ranks
from slide_hf.preference.head import METRIC_NAMES

STEPS = 3
LAUNCH_TIMEOUT_S = 180.0
RTOL = 1e-5
ATOL = 1e-6
"""Where a value cancels: a reward is a difference of two completions' log-probabilities of ~20 nats
each, which fp32 rounds ~1e-6 apart when the ranks' gradients were summed in another order."""
TRAINED = ("loss", "loss_tokens", *METRIC_NAMES)
EVALUATED = ("eval_loss", "eval_loss_tokens", *(f"eval_{name}" for name in METRIC_NAMES))


def _pairs(path: Path, count: int, op: str) -> Path:
    records = []
    for i in range(count):
        a, b = i % 7 + 1, i % 5 + 2
        value = a + b if op == "+" else a * b
        records.append({"prompt": f"{a}{op}{b}=", "chosen": f"{value}.", "rejected": f"{value + 1 + i % 3}?"})
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _train(world_size: int, *args: str) -> list[tuple[int, str]]:
    """``python -m slide_hf train`` + ``args`` in ``world_size`` processes (one plain process for 1); each
    rank's (exit code, stderr), every rank killed past the timeout."""
    command = [sys.executable, "-m", "slide_hf", "train", *args]
    procs = launch_ranks(command, world_size, launched=world_size > 1, stdout=subprocess.DEVNULL)
    finished = wait_ranks(procs, LAUNCH_TIMEOUT_S)
    for rank, (code, err) in enumerate(finished):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    return finished


def _run(data_dir: Path, output: Path, objective: str, world_size: int) -> Path:
    """A run of ``objective`` at the global batch of 2 pairs a micro-batch, its checkpoints at steps 2 and 3."""
    _train(
        world_size,
        "--model", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--seq-len", "64", "--lr", "1e-3",
        "--objective", objective, "--data", str(data_dir / "pairs.jsonl"), "--no-packing",
        "--eval-data", str(data_dir / "held-out.jsonl"), "--eval-every", "2",
        "--batch-size", str(2 // world_size), "--grad-accum", "2", "--steps", str(STEPS), "--save-every", "2",
        "--output", str(output),
    )  # fmt: skip
    return output


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pairs")
    _pairs(folder / "pairs.jsonl", 16, "+")
    _pairs(folder / "held-out.jsonl", 5, "*")
    return folder


@pytest.fixture(scope="module")
def run_of(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], Path]:
    """The run of an objective in one process or 2 ranks, made once, when a test first asks for it."""

    @functools.cache
    def run(objective: str, world_size: int) -> Path:
        return _run(data_dir, tmp_path_factory.mktemp(f"{objective}-{world_size}") / "run", objective, world_size)

    return run


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _steps(run: Path) -> list[dict[str, Any]]:
    return [record for record in _records(run) if "loss" in record]


def _evaluations(run: Path) -> list[dict[str, Any]]:
    return [record for record in _records(run) if "eval_loss" in record]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["dpo", "simpo"])
def test_two_ranks_train_as_one_process(objective: str, run_of: Callable[[str, int], Path]) -> None:
    """Per step the loss, its divisor (the global batch's pairs) and TRL's metrics over the global batch; the
    evaluations' loss and metrics over every held-out pair; and the exported weights: 2 ranks as one
    process within 1e-5 relative (the ranks sum their gradients in another order). DPO's reference pass
    ran once, each rank on its share, and rank 0 saved it."""
    one, two = run_of(objective, 1), run_of(objective, 2)
    for want, got in ((_steps(one), _steps(two)), (_evaluations(one), _evaluations(two))):
        assert [r["step"] for r in got] == [r["step"] for r in want] and got
        for ours, theirs in zip(got, want, strict=True):
            for key in TRAINED if "loss" in theirs else EVALUATED:
                assert ours[key] == pytest.approx(theirs[key], rel=RTOL, abs=ATOL), (ours["step"], key)
    assert [r["loss_tokens"] for r in _steps(two)] == [4] * STEPS  # the pairs of both ranks' rows
    assert [r["eval_loss_tokens"] for r in _evaluations(two)] == [5, 5]
    assert _steps(two)[-1]["rewards/margins"] > 0  # training moved the rewards: the test can tell
    want_weights, got_weights = _weights(one), _weights(two)
    assert got_weights.keys() == want_weights.keys()
    for name, tensor in want_weights.items():
        relative = float((got_weights[name] - tensor).norm() / tensor.norm())
        assert relative <= RTOL, f"{name} differs by {relative:.2e} relative"
    saved = sorted((two / ".data-cache" / "reference").glob("logps-*"))
    log = (two / "train.log").read_text()
    if objective == "dpo":  # the training pairs' pass and the held-out pairs', no partial file left
        assert [path.suffix for path in saved] == [".pt", ".pt"]
        one_saved = sorted((one / ".data-cache" / "reference").glob("logps-*.pt"))
        assert [path.name for path in saved] == [path.name for path in one_saved]  # keyed as one process's
        for ours, theirs in zip(saved, one_saved, strict=True):
            torch.testing.assert_close(torch.load(ours), torch.load(theirs), rtol=RTOL, atol=ATOL)
        assert log.count("micro-batches in") == 2 and "(each of 2 ranks its share)" in log
    else:
        assert not saved and "micro-batches in" not in log


@pytest.mark.slow
def test_a_resume_of_two_ranks_reads_the_reference_pass(run_of: Callable[[str, int], Path], tmp_path: Path) -> None:
    """A copy of the 2-rank DPO run resumed from its step-2 checkpoint in 2 ranks: neither reference pass runs
    again (the saved files are read, untouched), and step 3, its evaluation and the weights are the
    uninterrupted run's bit for bit."""
    whole = run_of("dpo", 2)
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    saved = sorted((run / ".data-cache" / "reference").glob("logps-*.pt"))
    stamps = [path.stat().st_mtime_ns for path in saved]
    finished = _train(2, "--resume", str(run / "checkpoints" / "step-00000002"))
    err = finished[0][1]
    assert "micro-batches in" not in err, err[-3000:]  # no pass ran
    assert err.count("reference log-probabilities of") == 2 and " from " in err
    assert [path.stat().st_mtime_ns for path in saved] == stamps
    timeless = [{k: v for k, v in r.items() if k in (*TRAINED, *EVALUATED, "step")} for r in _records(run)]
    assert timeless == [{k: v for k, v in r.items() if k in (*TRAINED, *EVALUATED, "step")} for r in _records(whole)]
    assert len(_steps(run)) == STEPS
    want, got = _weights(whole), _weights(run)
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())
