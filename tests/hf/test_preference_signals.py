"""A signal during DPO's reference pass (Note [A stop during the reference pass] in
slide_hf/preference/reference.py): the pass stops within one of its evaluations, the run ends in one line
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
