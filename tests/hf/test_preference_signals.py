"""A signal during DPO's reference pass (Note [A stop during the reference pass] in
slide_hf/preference/reference.py): the pass stops within one of its evaluations (with data parallel, every
rank after the same one, whichever rank the signal reached), the run ends in one line
with the signal's exit status and saves nothing, and the same command with --overwrite starts it again."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from slide_core.engine import Engine

pytest.importorskip("transformers")

PAIRS = 96
"""One pair a row at batch 1: 96 micro-batches, evaluated 8 at a time (the pass's smallest evaluation)."""


def _pairs(path: Path) -> Path:
    rows = [{"prompt": f"Q{i}?", "chosen": f"yes {i}", "rejected": f"no {i + 1}"} for i in range(PAIRS)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_reference_pass_stops_it_and_saves_nothing(
    signum: signal.Signals, slide, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = tmp_path / "run"
    argv = (
        "train", "--device", "cpu", "--dtype", "float32", "--seq-len", "64", "--batch-size", "1", "--steps", "2",
        "--no-packing", "--objective", "dpo", "--data", _pairs(tmp_path / "pairs.jsonl"), "--output", output,
    )  # fmt: skip
    evaluate = Engine.evaluate
    calls: list[int] = []

    def evaluating(engine: Engine, batches, *args, **kwargs):
        calls.append(len(batches))
        if len(calls) == 2:  # the signal comes while the pass's second evaluation runs
            os.kill(os.getpid(), signum)
        return evaluate(engine, batches, *args, **kwargs)

    monkeypatch.setattr(Engine, "evaluate", evaluating)
    status, _, err = slide(*argv)
    assert status == 128 + signum
    (line,) = [line for line in err.splitlines() if line.startswith("slide train:")]
    name = signal.Signals(signum).name
    assert f"stopped by {name} during the reference pass, after 16 of its {PAIRS} micro-batches" in line
    assert "nothing is trained or saved yet" in line and "--overwrite" in line
    assert calls == [8, 8]  # the pass went no further than the evaluation the signal came in
    assert not list(output.rglob("logps-*")) and not list(output.rglob("step-*"))

    monkeypatch.setattr(Engine, "evaluate", evaluate)
    status, _, err = slide(*argv, "--overwrite")
    assert status == 0, err
    assert len(list(output.rglob("logps-*"))) == 1 and (output / "model").is_dir()


_RANK_SIGNALLED = """
import os, signal, sys
from slide_core.engine import Engine
from slide_hf.cli.main import main

evaluate, calls = Engine.evaluate, []

def evaluating(engine, batches, *args, **kwargs):
    calls.append(len(batches))
    if os.environ["RANK"] == "1" and len(calls) == 2:  # a scheduler's SIGTERM that reaches rank 1 alone
        os.kill(os.getpid(), signal.SIGTERM)
    return evaluate(engine, batches, *args, **kwargs)

Engine.evaluate = evaluating
status = main(sys.argv[1:])
print(f"evaluations {len(calls)}", file=sys.stderr)
sys.exit(status)
"""


@pytest.mark.slow
def test_a_signal_to_one_rank_during_the_reference_pass_stops_every_rank(tmp_path: Path) -> None:
    """With data parallel the ranks sum their stop requests after each evaluation of the pass, so a SIGTERM
    that reaches one rank stops both after the same evaluation, with 143 and one line; none hangs."""
    import subprocess
    import sys

    from slide_core.testing import launch_ranks, wait_ranks

    argv = (
        "train", "--device", "cpu", "--dtype", "float32", "--seq-len", "64", "--batch-size", "1", "--steps", "2",
        "--no-packing", "--objective", "dpo", "--data", str(_pairs(tmp_path / "pairs.jsonl")),
        "--output", str(tmp_path / "run"),
    )  # fmt: skip
    command = [sys.executable, "-c", _RANK_SIGNALLED, *argv]
    finished = wait_ranks(launch_ranks(command, 2, launched=True, stdout=subprocess.DEVNULL), 180.0)
    for rank, (code, err) in enumerate(finished):
        assert code == 143, f"rank {rank}:\n{err[-3000:]}"
        assert "evaluations 2" in err, f"rank {rank}:\n{err[-3000:]}"
    half = PAIRS // 2
    assert f"during the reference pass, after 16 of its {half} micro-batches on each rank" in finished[0][1]
    assert not list((tmp_path / "run").rglob("logps-*"))
