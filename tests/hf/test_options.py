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


# ---- mixtures: several --data and --data-weights -------------------------------------------------------------


def test_several_data_sources_and_their_weights():
    one = TrainConfig(data=["a.jsonl"])
    assert one.data == Path("a.jsonl")  # one source stays a path, as before
    cfg = TrainConfig(data=["a.jsonl", "b.jsonl"], data_weights="0.7,0.3")
    assert cfg.data == (Path("a.jsonl"), Path("b.jsonl")) and cfg.data_weights == (0.7, 0.3)
    assert TrainConfig(data=("a.jsonl", "b.jsonl"), data_weights=[3, 1]).data_weights == (3.0, 1.0)
    saved = config_dict(cfg)
    assert saved["data"] == ["a.jsonl", "b.jsonl"] and saved["data_weights"] == [0.7, 0.3]
    resumed = resume_config(saved, {"data": ["a.jsonl", "b.jsonl"], "data_weights": "0.7,0.3"}, source="ck")
    assert resumed.data == cfg.data and resumed.data_weights == cfg.data_weights
    with pytest.raises(UserError, match=r"^--data-weights was \[0\.7, 0\.3\] in the run at ck and is '1,1' now"):
        resume_config(saved, {"data_weights": "1,1"}, source="ck")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"data": ["a", "b"], "data_weights": "3,1,1"}, r"--data-weights gives 3 weight\(s\) for 2 --data source\(s\)"),
        ({"data": "a", "data_weights": "3,1"}, r"--data-weights gives 2 weight\(s\) for 1 --data source\(s\)"),
        ({"data_weights": [1]}, r"--data-weights gives 1 weight\(s\) for 0 --data source\(s\)"),
        ({"data": ["a", "b"], "data_weights": "3,-1"}, "--data-weights must be positive finite numbers.*'-1'"),
        ({"data": ["a", "b"], "data_weights": "3,0"}, "--data-weights must be positive finite numbers.*'0'"),
        ({"data": ["a", "b"], "data_weights": "3,nan"}, "--data-weights must be positive finite numbers.*'nan'"),
        ({"data": ["a", "b"], "data_weights": [3, math.inf]}, "--data-weights must be positive finite numbers.*inf"),
        ({"data": ["a", "b"], "data_weights": "3,x"}, "--data-weights must be positive finite numbers.*'x'"),
        ({"data": ["a", "b"], "data_weights": [3, True]}, "--data-weights must be positive finite numbers.*True"),
        ({"data": ["a", ""]}, "--data must name a file"),
        ({"data": []}, "--data must name at least one source"),
    ],
)
def test_bad_data_weights_are_one_line_naming_the_flag(kwargs, match):
    with pytest.raises(UserError, match=match):
        TrainConfig(**kwargs)


# ---- AdamW hyperparameters that cannot run, sizes from TOML, ranks past the cores ----------------------------


@pytest.mark.parametrize("eps", [1e-300, 1e-39, 0.0, -1e-8])
def test_adam_eps_must_be_a_normal_fp32_number(eps):
    with pytest.raises(UserError, match=r"^--adam-eps must be a finite number in \[1\.17549e-38, 1\]"):
        TrainConfig(adam_eps=eps)
    assert TrainConfig(adam_eps=1.2e-38).adam_eps == 1.2e-38


@pytest.mark.parametrize(("lr", "wd"), [(1e-3, 1e30), (0.1, 10.0), (1.0, 1.0)])
def test_weight_decay_that_flips_the_weights_is_refused(lr, wd):
    with pytest.raises(UserError, match=r"^--weight-decay .* with --lr .* lr \* wd must be below 1"):
        TrainConfig(lr=lr, weight_decay=wd)
    assert TrainConfig(lr=lr, weight_decay=0.99 / lr).weight_decay == 0.99 / lr


@pytest.mark.parametrize("value", [24, 1.5, "24", "24GiB"])
def test_sizes_take_plain_numbers_as_gib(value):
    assert TrainConfig(gpu_memory=value).gpu_memory == str(value)


def test_a_boolean_size_is_refused():
    with pytest.raises(UserError, match="--gpu-memory must be a size"):
        TrainConfig(gpu_memory=True)


def test_slide_train_refuses_eps_and_weight_decay_before_training(tmp_path, capsys):
    from slide_hf.cli.main import main

    base = ["train", "--device", "cpu", "--steps", "1", "--seq-len", "16", "--output", str(tmp_path / "run")]
    assert main([*base, "--adam-eps", "1e-300"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["slide train: error: --adam-eps must be a finite number in [1.17549e-38, 1], got 1e-300"]
    assert main([*base, "--weight-decay", "1e30"]) == 2  # the preset's default lr, 1e-3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slide train: error: --weight-decay 1e+30 with the default --lr 0.001")
    assert "lr * wd must be below 1" in err[0]


def test_toml_takes_data_lists_weights_and_plain_number_sizes(tmp_path):
    from slide_hf.cli.main import build_parser
    from slide_hf.cli.train import build_config

    config = tmp_path / "run.toml"
    config.write_text(
        'data = ["a.jsonl", "b.jsonl"]\ndata_weights = [3, 1]\ngpu_memory = 24\nmax_record_size = "64MiB"\n'
    )
    cfg = build_config(build_parser().parse_args(["train", "--config", str(config)]))
    assert cfg.data == (Path("a.jsonl"), Path("b.jsonl")) and cfg.data_weights == (3.0, 1.0)
    assert cfg.gpu_memory == "24" and cfg.max_record_bytes == 64 << 20
    flags = ["train", "--data", "a.jsonl", "--data", "b.jsonl", "--data-weights", "0.7,0.3"]
    cfg = build_config(build_parser().parse_args(flags))
    assert cfg.data == (Path("a.jsonl"), Path("b.jsonl")) and cfg.data_weights == (0.7, 0.3)
    config.write_text('data = ["a.jsonl", 5]\n')
    with pytest.raises(UserError, match=r"data must be a list of Path, got \['a.jsonl', 5\]"):
        build_config(build_parser().parse_args(["train", "--config", str(config)]))
    config.write_text("data_weights = 3\n")
    with pytest.raises(UserError, match="data_weights must be a list of float, got 3"):
        build_config(build_parser().parse_args(["train", "--config", str(config)]))
