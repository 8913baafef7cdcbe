"""slide_hf.options: one validation layer for every way into a run, and what a resumed run may change."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from slide_hf.errors import UserError
from slide_hf.options import RULES, TrainConfig, check_option, config_dict, resume_config

FLOAT_OPTIONS = sorted(name for name, rule in RULES.items() if rule.kind == "float")
INT_OPTIONS = sorted(name for name, rule in RULES.items() if rule.kind == "int")


@pytest.mark.parametrize("name", FLOAT_OPTIONS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_option_refuses_nan_and_infinities(name, value):
    with pytest.raises(UserError, match=rf"^--{name.replace('_', '-')} must be a finite number"):
        TrainConfig(**{name: value})


@pytest.mark.parametrize("name", INT_OPTIONS)
@pytest.mark.parametrize("value", [-1, 2**64, 2.5, True])
def test_every_int_option_refuses_out_of_range_fractional_and_boolean_values(name, value):
    with pytest.raises(UserError, match=rf"^--{name.replace('_', '-')} must be an integer"):
        TrainConfig(**{name: value})


def test_huge_seed_is_named_too_large():
    with pytest.raises(UserError, match=r"--seed must be an integer >= 0, got 99999999999999999999 \(too large\)"):
        TrainConfig(seed=99999999999999999999)


@pytest.mark.parametrize(
    ("name", "value"),
    [("device", "tpu"), ("dtype", "float16"), ("lr_schedule", "step"), ("offload_optimizer", "disk")],
)
def test_choices_list_what_is_accepted(name, value):
    with pytest.raises(UserError, match="must be one of"):
        TrainConfig(**{name: value})


def test_defaults_pass_and_none_means_choose_for_me():
    cfg = TrainConfig(lr=None, steps=None, epochs=None)
    assert cfg.lr is None and cfg.seq_len is None  # seq_len: resolved against the model (slide_hf/defaults.py)


def test_check_option_names_the_callers_flag():
    with pytest.raises(UserError, match=r"^--batch-size must be an integer >= 1, got 0$"):
        check_option("batch_size", 0)
    check_option("batch_size", 8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"report_to": "tensorboard,neptune"}, "--report-to must name tensorboard, wandb, mlflow; got 'neptune'"),
        ({"gpu_memory": "nanGiB"}, "--gpu-memory: cannot read 'nanGiB'"),
        ({"gpu_memory": "1e400"}, "--gpu-memory: cannot read '1e400'"),
        ({"eval_fraction": 0.1, "eval_data": Path("e.jsonl")}, "give one"),
        ({"save_best": True}, "--save-best needs evaluation data"),
        ({"output": ""}, "--output must not be empty"),
        ({"metrics": ""}, "--metrics must not be empty"),
        ({"eval_fraction": 1.0}, "--eval-fraction must be a finite number in [0, 1)"),
    ],
)
def test_cross_option_rules(kwargs, match):
    with pytest.raises(UserError, match=match.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**kwargs)


def test_report_to_accepts_a_comma_list_and_paths_accept_strings():
    cfg = TrainConfig(report_to="tensorboard, mlflow", data="d.jsonl", output="out")
    assert cfg.report_to == ("tensorboard", "mlflow")
    assert cfg.data == Path("d.jsonl") and cfg.output == Path("out")


def _saved(**overrides):
    return config_dict(TrainConfig(model="tiny-llama", batch_size=2, steps=4, lr=1e-3, **overrides))


def test_resume_restores_saved_options_and_lets_safe_ones_change():
    cfg = resume_config(_saved(), {"resume": Path("run"), "steps": 9, "save_every": 3}, source="run/ck")
    assert (cfg.batch_size, cfg.lr, cfg.steps, cfg.save_every) == (2, 1e-3, 9, 3)


def test_resume_allows_moving_the_run_to_another_machine():
    cfg = resume_config(_saved(), {"device": "cpu", "gpu_memory": "12", "block_slots": 3}, source="ck")
    assert (cfg.device, cfg.gpu_memory, cfg.block_slots) == ("cpu", "12", 3)


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [("batch_size", 4, "--batch-size was 2"), ("lr", 5e-4, "--lr was 0.001"), ("seed", 1, "--seed was 0")],
)
def test_resume_refuses_an_unsafe_change_naming_both_values(key, value, shown):
    with pytest.raises(UserError, match=rf"^{shown} in the run at ck and is {value!r} now"):
        resume_config(_saved(), {key: value}, source="ck")


def test_resume_compares_model_paths_resolved(tmp_path, monkeypatch):
    (tmp_path / "tinyqwen").mkdir()
    monkeypatch.chdir(tmp_path)
    saved = config_dict(TrainConfig(model="tinyqwen"))
    assert saved["model"] == str(tmp_path / "tinyqwen")  # saved resolved: a resume finds it from anywhere
    assert resume_config(saved, {"model": "./tinyqwen"}, source="ck").model == saved["model"]  # no refusal
    with pytest.raises(UserError, match=r"--model was '/.*/tinyqwen'"):
        resume_config(saved, {"model": "tiny-llama"}, source="ck")


def test_the_runs_own_metrics_file_follows_the_run_directory(tmp_path):
    saved = config_dict(TrainConfig(output=tmp_path / "run", metrics=tmp_path / "run" / "m.jsonl"))
    assert resume_config(saved, {}, source="ck").metrics is None  # the resumed run's own default
    elsewhere = config_dict(TrainConfig(output=tmp_path / "run", metrics=tmp_path / "logs" / "m.jsonl"))
    assert resume_config(elsewhere, {}, source="ck").metrics == tmp_path / "logs" / "m.jsonl"


def test_resume_equal_values_of_other_types_pass():
    saved = _saved()
    assert resume_config(saved, {"lr": 0.001, "batch_size": 2}, source="ck").lr == 1e-3
