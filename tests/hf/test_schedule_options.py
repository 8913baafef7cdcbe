"""The lr schedule options of `slide train` beyond linear, cosine and wsd: ``--warmup-ratio``,
``cosine_with_restarts`` (``--lr-cycles``), ``polynomial`` (``--lr-power``, ``--lr-end``) and
``inverse_sqrt`` (``--lr-timescale``). The lr each step's metrics record is the schedule's; an option that
shapes another schedule than the run's, or two warmups, is one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from slide_core import LRSchedule

TINY = ("--device", "cpu", "--dtype", "float32", "--seq-len", "32", "--batch-size", "2")


def _lrs(slide, output: Path, *extra: str | Path) -> list[float]:
    status, _, err = slide("train", "--output", output, *TINY, *extra)
    assert status == 0, err
    return [json.loads(line)["lr"] for line in (output / "metrics.jsonl").read_text().splitlines()]


def test_polynomial_with_a_warmup_ratio(slide, tmp_path):
    options = "--steps 8 --lr 1e-3 --lr-schedule polynomial --lr-power 2 --lr-end 1e-4 --warmup-ratio 0.2"
    lrs = _lrs(slide, tmp_path / "run", *options.split())
    want = LRSchedule(1e-3, "polynomial", math.ceil(8 * 0.2), 8, power=2.0, end_lr=1e-4)
    assert want.warmup_steps == 2 and lrs == [want.lr_at(step) for step in range(8)]
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-3)


def test_restarts_from_a_toml_file(slide, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('lr_schedule = "cosine_with_restarts"\nlr_cycles = 2\nlr = 1e-3\nsteps = 8\nwarmup_ratio = 0.1\n')
    lrs = _lrs(slide, tmp_path / "run", "--config", toml)
    want = LRSchedule(1e-3, "cosine_with_restarts", 1, 8, cycles=2)
    assert lrs == [want.lr_at(step) for step in range(8)]
    assert lrs[5] > lrs[4]  # the restart


def test_inverse_sqrt_with_a_timescale(slide, tmp_path):
    options = "--steps 5 --lr 1e-3 --lr-schedule inverse_sqrt --warmup-steps 1 --lr-timescale 2"
    lrs = _lrs(slide, tmp_path / "run", *options.split())
    assert lrs == [LRSchedule(1e-3, "inverse_sqrt", 1, 5, timescale=2).lr_at(step) for step in range(5)]
    assert lrs[4] == pytest.approx(1e-3 / math.sqrt(5 / 2))


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["--warmup-steps", "2", "--warmup-ratio", "0.1"],
            "--warmup-steps 2 and --warmup-ratio 0.1 both set the warmup",
        ),
        (["--warmup-ratio", "1.5"], "--warmup-ratio must be a finite number in [0, 1], got 1.5"),
        (
            ["--lr-cycles", "3"],
            "--lr-cycles 3 shapes --lr-schedule cosine_with_restarts only, and the schedule is linear",
        ),
        (["--lr-schedule", "cosine", "--lr-power", "2"], "--lr-power 2.0 shapes --lr-schedule polynomial only"),
        (["--lr-end", "0"], "--lr-end 0.0 shapes --lr-schedule polynomial only"),
        (["--lr-timescale", "10"], "--lr-timescale 10 shapes --lr-schedule inverse_sqrt only"),
        (["--lr-cycles", "1"], "--lr-cycles 1 shapes --lr-schedule cosine_with_restarts only"),  # at its default
        (["--lr-schedule", "polynomial", "--lr-power", "0"], "--lr-power must be a finite number > 0, got 0.0"),
        (
            ["--lr-schedule", "cosine_with_restarts", "--lr-cycles", "0"],
            "--lr-cycles must be an integer in [1, 1000000]",
        ),
        (
            ["--lr-schedule", "polynomial", "--lr", "1e-4", "--lr-end", "1e-3"],
            "--lr-end 0.001 must be below --lr 0.0001",
        ),
        (["--lr-schedule", "polynomial", "--lr-end", "0.5"], "--lr-end 0.5 must be below --lr 0.001"),  # the default lr
        (["--lr-schedule", "polynomial", "--min-lr-ratio", "0.1"], "polynomial ends at --lr-end"),
        (["--lr-schedule", "inverse_sqrt", "--min-lr-ratio", "0.1"], "--lr-schedule inverse_sqrt has none"),
        (
            ["--lr-schedule", "exponential"],
            "--lr-schedule must be one of constant, linear, cosine, wsd, "
            "cosine_with_restarts, polynomial, inverse_sqrt",
        ),
    ],
)
def test_bad_schedule_options_are_one_line(slide, tmp_path, argv, match):
    status, _, err = slide("train", "--output", tmp_path / "x", *TINY, "--steps", "2", *argv)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert match in lines[0], lines[0]
    assert not (tmp_path / "x" / "checkpoints").exists()


def test_a_resume_keeps_the_warmup_the_ratio_gave(slide, tmp_path):
    """The ratio is of the first run's length; a longer resume continues the saved curve (its warmup done)."""
    run = tmp_path / "run"
    first = _lrs(slide, run, "--steps", "4", "--lr", "1e-3", "--warmup-ratio", "0.5")
    assert first[:3] == [0.0, 5e-4, 1e-3]
    status, _, err = slide("train", "--resume", run, "--steps", "8")
    assert status == 0, err
    lrs = [json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    want = LRSchedule(1e-3, "linear", 2, 4).extend(4, 8)
    assert lrs[4:] == [want.lr_at(step) for step in range(4, 8)]


def test_the_help_names_the_schedules_and_options(slide):
    status, out, _ = slide("train", "--help")
    assert status == 0
    for text in (
        "cosine_with_restarts",
        "polynomial",
        "inverse_sqrt",
        "--warmup-ratio",
        "--lr-cycles",
        "--lr-power",
        "--lr-end",
        "--lr-timescale",
    ):
        assert text in out, text
