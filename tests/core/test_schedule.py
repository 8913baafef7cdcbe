"""LR schedules: exact values at the steps that define each curve, the floor, WSD, and extensions."""

from __future__ import annotations

import math

import pytest

from slide_core import LRSchedule


def test_zero_floor_is_transformers_linear_and_cosine() -> None:
    from torch import nn, optim
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    for kind, make in (("linear", get_linear_schedule_with_warmup), ("cosine", get_cosine_schedule_with_warmup)):
        opt = optim.SGD(nn.Linear(1, 1).parameters(), lr=3e-4)
        hf = make(opt, num_warmup_steps=2, num_training_steps=20)
        ours = LRSchedule(3e-4, kind, warmup_steps=2, total_steps=20)
        for step in range(20):
            assert ours.lr_at(step) == opt.param_groups[0]["lr"], (kind, step)
            opt.step()
            hf.step()


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_floor(kind: str) -> None:
    s = LRSchedule(1.0, kind, warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert s.lr_at(0) == 0.0 and s.lr_at(1) == 0.5  # the warmup starts from 0, not the floor
    assert s.lr_at(2) == 1.0
    assert s.lr_at(7) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay, either shape
    assert s.lr_at(12) == pytest.approx(0.1)
    assert min(s.lr_at(step) for step in range(2, 40)) == pytest.approx(0.1)


@pytest.mark.parametrize(("shape", "at_8", "at_9"), [("linear", 2 / 3, 1 / 3), ("cosine", 0.75, 0.25)])
def test_wsd(shape: str, at_8: float, at_9: float) -> None:
    s = LRSchedule(2.0, "wsd", warmup_steps=2, total_steps=10, decay_fraction=0.3, decay_shape=shape, min_lr_ratio=0.1)
    assert [s.lr_at(step) for step in range(8)] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert s.lr_at(8) == pytest.approx(0.2 + 1.8 * at_8)
    assert s.lr_at(9) == pytest.approx(0.2 + 1.8 * at_9)
    assert s.lr_at(10) == pytest.approx(0.2)


def test_wsd_with_the_whole_run_decaying_is_linear() -> None:
    wsd = LRSchedule(1.0, "wsd", warmup_steps=3, total_steps=10, decay_fraction=1.0)
    linear = LRSchedule(1.0, "linear", warmup_steps=3, total_steps=10)
    assert [wsd.lr_at(step) for step in range(10)] == [linear.lr_at(step) for step in range(10)]


def test_extension_keeps_the_curve_continuous() -> None:
    s = LRSchedule(1.0, "cosine", total_steps=20)
    mid = s.extend(10, 30)
    assert [mid.lr_at(step) for step in range(10)] == [s.lr_at(step) for step in range(10)]
    assert mid.lr_at(10) == s.lr_at(10) == pytest.approx(0.5)
    assert mid.lr_at(20) == pytest.approx(0.5 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert mid.lr_at(30) == pytest.approx(0.0, abs=1e-12)
    # A finished run stays at its floor: nothing jumps back up the curve.
    done = LRSchedule(1.0, "cosine", total_steps=20, min_lr_ratio=0.05).extend(20, 30)
    assert [done.lr_at(step) for step in range(20, 31)] == pytest.approx([0.05] * 11)
    # Extended twice, and rebuilt from what a checkpoint keeps.
    twice = mid.extend(25, 40)
    assert twice.final_steps == 40 and twice.lr_at(25) == pytest.approx(mid.lr_at(25))
    assert LRSchedule.from_dict(twice.to_dict()) == twice


def test_extension_during_warmup_plans_the_new_length() -> None:
    s = LRSchedule(1.0, "linear", warmup_steps=5, total_steps=10).extend(3, 20)
    assert s == LRSchedule(1.0, "linear", warmup_steps=5, total_steps=20)


def test_wsd_extended_in_its_stable_phase_decays_at_the_new_end() -> None:
    s = LRSchedule(1.0, "wsd", total_steps=100, decay_fraction=0.1).extend(50, 200)
    assert s.lr_at(179) == 1.0 and s.lr_at(180) == 1.0 and s.lr_at(190) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("field", "value"),
    [("min_lr_ratio", 1.0), ("min_lr_ratio", -0.1), ("decay_fraction", 0.0), ("decay_fraction", 1.5)],
)
def test_bad_values_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        LRSchedule(1.0, "wsd", total_steps=10, **{field: value})
