"""The schedules beyond linear and cosine, step for step against the transformers functions they follow,
the warmup ratio as the HF Trainer turns it into steps, and their extensions on a resume."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from slide_core import LRSchedule
from slide_core.schedule import warmup_from_ratio

BASE_LR = 3e-4


def _hf_lrs(make: Callable[..., Any], steps: int, **kwargs: Any) -> list[float]:
    """The lr transformers' scheduler gives each of ``steps`` optimizer steps (LambdaLR, as the Trainer runs it)."""
    from torch import nn, optim

    opt = optim.SGD(nn.Linear(1, 1).parameters(), lr=BASE_LR)
    scheduler = make(opt, **kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return lrs


def _assert_same(ours: LRSchedule, theirs: list[float]) -> None:
    for step, want in enumerate(theirs):
        got = ours.lr_at(step)
        assert got == pytest.approx(want, rel=1e-12, abs=0.0), (ours.kind, step, got, want)


@pytest.mark.parametrize(("warmup", "total", "cycles"), [(0, 30, 1), (0, 41, 3), (5, 40, 2), (7, 23, 4), (3, 3, 2)])
def test_cosine_with_restarts_is_transformers(warmup: int, total: int, cycles: int) -> None:
    from transformers import get_cosine_with_hard_restarts_schedule_with_warmup as make

    theirs = _hf_lrs(make, total + 5, num_warmup_steps=warmup, num_training_steps=total, num_cycles=cycles)
    _assert_same(LRSchedule(BASE_LR, "cosine_with_restarts", warmup, total, cycles=cycles), theirs)


@pytest.mark.parametrize(
    ("warmup", "total", "power", "end_lr"),
    [(0, 30, 1.0, 1e-7), (0, 17, 2.0, 0.0), (4, 40, 0.5, 1e-5), (10, 25, 3.0, 2e-4)],
)
def test_polynomial_is_transformers(warmup: int, total: int, power: float, end_lr: float) -> None:
    from transformers import get_polynomial_decay_schedule_with_warmup as make

    theirs = _hf_lrs(make, total + 5, num_warmup_steps=warmup, num_training_steps=total, power=power, lr_end=end_lr)
    ours = LRSchedule(BASE_LR, "polynomial", warmup, total, power=power, end_lr=end_lr)
    _assert_same(ours, theirs)
    assert ours.lr_at(total + 100) == pytest.approx(end_lr, rel=1e-12)  # held after the last step


@pytest.mark.parametrize(("warmup", "timescale"), [(0, None), (8, None), (8, 3), (0, 50), (20, 100)])
def test_inverse_sqrt_is_transformers(warmup: int, timescale: int | None) -> None:
    from transformers import get_inverse_sqrt_schedule as make

    theirs = _hf_lrs(make, 200, num_warmup_steps=warmup, timescale=timescale)
    _assert_same(LRSchedule(BASE_LR, "inverse_sqrt", warmup, 60, timescale=timescale), theirs)


@pytest.mark.parametrize(("total", "ratio"), [(100, 0.03), (100, 0.07), (37, 0.1), (5, 0.0), (999, 0.999)])
def test_warmup_ratio_is_the_trainers(total: int, ratio: float) -> None:
    """The Trainer's own arithmetic (transformers 5 takes the ratio as a ``warmup_steps`` below 1)."""
    from transformers import TrainingArguments

    args = SimpleNamespace(warmup_steps=ratio, warmup_ratio=ratio)
    assert warmup_from_ratio(total, ratio) == TrainingArguments.get_warmup_steps(args, total)  # type: ignore[arg-type]


def test_a_warmup_ratio_of_one_warms_up_over_the_whole_run() -> None:
    assert warmup_from_ratio(8, 1.0) == 8


def test_the_earlier_schedules_keep_their_values() -> None:
    """The new fields change nothing for linear, cosine, wsd and constant: the same curve, bit for bit,
    as the formulas these schedules have always had."""
    for kind in ("linear", "cosine", "wsd", "constant"):
        s = LRSchedule(1.0, kind, warmup_steps=2, total_steps=12, min_lr_ratio=0.0 if kind == "constant" else 0.1)
        for step in range(2, 16):
            progress = min(1.0, (step - 2) / 10)
            wsd_at = 12 - max(1, math.ceil(0.1 * 12))
            want = {
                "constant": 1.0,
                "linear": 0.1 + 0.9 * max(0.0, (12 - step) / 10),
                "cosine": 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)),
                "wsd": 1.0 if step < wsd_at else 0.1 + 0.9 * max(0.0, (12 - step) / (12 - wsd_at)),
            }[kind]
            assert s.lr_at(step) == pytest.approx(want, rel=1e-15), (kind, step)


def test_restarts_extension_keeps_the_phase_and_the_restarts() -> None:
    s = LRSchedule(1.0, "cosine_with_restarts", 0, 20, cycles=2)
    longer = s.extend(5, 35)
    assert [longer.lr_at(step) for step in range(6)] == [s.lr_at(step) for step in range(6)]
    # 0.5 of 2 cycles done at step 5; the 1.5 left spread over 30 steps: the restart comes at step 15.
    assert longer.lr_at(14) < 0.01 and longer.lr_at(16) > 0.99
    assert longer.lr_at(35) == 0.0
    finished = s.extend(20, 30)
    assert [finished.lr_at(step) for step in range(20, 31)] == [0.0] * 11


def test_polynomial_extension_runs_from_the_lr_reached_to_end_lr() -> None:
    s = LRSchedule(1.0, "polynomial", 0, 10, power=2.0, end_lr=0.1)
    longer = s.extend(5, 20)
    assert longer.lr_at(5) == s.lr_at(5) == pytest.approx(0.1 + 0.9 * 0.25)
    assert longer.lr_at(20) == pytest.approx(0.1) and longer.lr_at(12) > s.lr_at(12) == pytest.approx(0.1)


def test_inverse_sqrt_does_not_depend_on_the_length() -> None:
    s = LRSchedule(1.0, "inverse_sqrt", 4, 10)
    longer = s.extend(8, 50)
    assert longer.extensions == () and [longer.lr_at(i) for i in range(60)] == [s.lr_at(i) for i in range(60)]


@pytest.mark.parametrize(
    "schedule",
    [
        LRSchedule(2e-5, "cosine_with_restarts", 3, 30, cycles=3, min_lr_ratio=0.1),
        LRSchedule(2e-5, "polynomial", 3, 30, power=2.0, end_lr=1e-6),
        LRSchedule(2e-5, "inverse_sqrt", 3, 30, timescale=7),
    ],
)
def test_a_checkpoint_rebuilds_the_same_curve(schedule: LRSchedule) -> None:
    extended = schedule.extend(10, 50)
    assert LRSchedule.from_dict(extended.to_dict()) == extended


def test_a_checkpoint_written_before_the_new_fields_reads_with_their_defaults() -> None:
    old = {"base_lr": 1.0, "kind": "cosine", "warmup_steps": 0, "total_steps": 5, "extensions": []}
    assert LRSchedule.from_dict(old) == LRSchedule(1.0, "cosine", 0, 5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "cosine_with_restarts", "cycles": 0}, "cycles"),
        ({"kind": "polynomial", "power": 0.0}, "power"),
        ({"kind": "polynomial", "end_lr": 1.0}, "smaller than the peak"),
        ({"kind": "inverse_sqrt", "timescale": 0}, "timescale"),
    ],
)
def test_bad_shape_parameters_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LRSchedule(1.0, total_steps=10, **kwargs)
