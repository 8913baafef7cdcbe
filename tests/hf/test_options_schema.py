"""slide_hf/options: each option declared once reaches every parser, the TOML file and the Python API it claims,
and each cross-option rule fires with the same line whichever way the options came in."""

from __future__ import annotations

import argparse
import importlib
import typing
from typing import Any

import pytest

from slide_core import plugins
from slide_hf.api import train_config
from slide_hf.cli import main as cli
from slide_hf.cli.train import build_config
from slide_hf.errors import UserError
from slide_hf.options import (
    COMMANDS,
    CROSS_RULES,
    RULES,
    Declared,
    DType,
    Launch,
    TrainConfig,
    toml_options,
    train_options,
)
from slide_hf.options.schema import declared
from slide_hf.spelling import keyword_spelling

EVERY_OPTION = (*declared(TrainConfig), *declared(Launch))


def _parser(command: str) -> argparse.ArgumentParser:
    commands = argparse.ArgumentParser().add_subparsers()
    importlib.import_module(f"slide_hf.cli.{command}").add_parser(commands)
    return commands.choices[command]


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_parses_exactly_the_options_that_claim_it(command):
    flags = _parser(command)._option_string_actions
    for item in EVERY_OPTION:
        assert (item.flag in flags) == item.takes(command), (item.name, command)
        if item.takes(command):
            action = flags[item.flag]
            assert action.dest == item.name  # the attribute is the option's name, as in TOML and the API
            assert action.help and "{" not in action.help  # the help's placeholders were filled


def test_plan_and_bench_take_their_own_defaults_and_train_leaves_them_for_the_toml_file():
    plan = _parser("plan").parse_args(["--model", "m"])
    bench = _parser("bench").parse_args([])
    train = _parser("train").parse_args([])
    assert (plan.batch_size, bench.batch_size, train.batch_size) == (1, 16, None)
    assert (bench.model, bench.steps, plan.nproc_per_node) == ("llama3.2-3b", 6, 1)


def _sample(item: Declared) -> Any:
    """A TOML value of the option's type (the default where TOML can hold it)."""
    if item.default is not None and not isinstance(item.default, tuple):
        return item.default.value if hasattr(item.default, "value") else item.default
    is_tuple = typing.get_origin(item.hint) is tuple
    members = (item.hint,) if is_tuple else typing.get_args(item.hint) or (item.hint,)
    if any(typing.get_origin(m) is tuple for m in members):
        inner = typing.get_args(next(m for m in members if typing.get_origin(m) is tuple))[0]
        return [1.0] if inner is float else ["tensorboard"] if inner is str else ["a.jsonl"]
    return 1 if (int in members or float in members) and str not in members else "x"


@pytest.mark.parametrize("item", train_options(), ids=lambda item: item.name)
def test_every_run_option_is_a_toml_key_and_an_api_keyword(item, tmp_path):
    value = _sample(item)
    config = tmp_path / "run.toml"
    rendered = repr(value).replace("'", '"').replace("True", "true").replace("False", "false")
    config.write_text(f"{item.name} = {rendered}\n")
    assert item.name in toml_options(config)
    if item.name == "resume":
        return  # a keyword that reads a saved run; its spelling is the field's like the others
    cfg = train_config(**{item.name: item.default})
    assert getattr(cfg, item.name) == item.normalised(item.default)


def test_launch_options_are_neither_toml_keys_nor_api_keywords(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("nproc_per_node = 2\n")
    with pytest.raises(UserError, match="unknown option 'nproc_per_node'"):
        toml_options(config)
    with pytest.raises(TypeError, match="nproc_per_node"):
        train_config(nproc_per_node=2)


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16"])
def test_one_dtype_enum_whatever_the_spelling(spelling, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'dtype = "{spelling}"\n')
    from_toml = build_config(cli.build_parser().parse_args(["train", "--config", str(config)]))
    from_flag = build_config(cli.build_parser().parse_args(["train", "--dtype", spelling]))
    assert from_toml.dtype is from_flag.dtype is train_config(dtype=spelling).dtype is DType.BFLOAT16


def test_activation_tiers_come_from_the_registry():
    assert set(RULES["offload_activations"].names()) == {"ram", *plugins.available("slide.tiers")}


# ---- every cross-option rule, from the flags, the TOML file and the API ------------------------------------

RULE_CASES = {
    "master x dtype": ({"master": "split", "dtype": "float32"}, "--master split stores the bf16 copy"),
    "eval source": ({"eval_data": "e.jsonl", "eval_fraction": 0.1}, "both choose the evaluation data"),
    "best needs eval": ({"save_best": True}, "--save-best needs evaluation data"),
    "floor needs a decay": ({"min_lr_ratio": 0.1, "lr_schedule": "constant"}, "--min-lr-ratio is the floor"),
    "lr x weight decay": ({"lr": 0.1, "weight_decay": 10.0}, "--weight-decay 10 with --lr 0.1"),
    "disk tier needs a dir": ({"offload_optimizer": "nvme"}, "--offload-optimizer nvme needs --nvme-dir PATH"),
    "activations on disk": ({"offload_activations": "nvme"}, "--offload-activations nvme needs --nvme-dir"),
}


def _flags(options: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def _toml(options: dict[str, Any]) -> str:
    def value(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else repr(v).replace("'", '"')

    return "".join(f"{name} = {value(v)}\n" for name, v in options.items())


def _cli_error(capsys: Any, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err.strip().removeprefix(f"slide {argv[0]}: error: ")


@pytest.mark.parametrize("case", RULE_CASES, ids=str)
def test_each_rule_fires_identically_from_flags_toml_and_api(case, tmp_path, capsys):
    options, expected = RULE_CASES[case]
    with pytest.raises(UserError) as from_api:
        train_config(**options)
    message = str(from_api.value)
    assert expected in message
    assert _cli_error(capsys, ["train", *_flags(options)]) == message
    config = tmp_path / "run.toml"
    config.write_text(_toml(options))
    assert _cli_error(capsys, ["train", "--config", str(config)]) == message
    with keyword_spelling(), pytest.raises(UserError) as keyworded:  # the API names keywords, not flags
        train_config(**options)
    assert "--" not in str(keyworded.value).split(";")[0]


def test_int8_state_refuses_data_parallel_from_flags_toml_plan_and_the_run(tmp_path, capsys):
    cfg = train_config(optimizer_state="int8")
    with pytest.raises(UserError) as refused:
        cfg.validate(2)  # what the recipe calls with its process group's size
    message = str(refused.value)
    assert message.startswith("--optimizer-state int8 does not run with data parallel (2 processes)")
    assert _cli_error(capsys, ["train", "--optimizer-state", "int8", "--nproc-per-node", "2"]) == message
    config = tmp_path / "run.toml"
    config.write_text('optimizer_state = "int8"\n')
    assert _cli_error(capsys, ["train", "--config", str(config), "--nproc-per-node", "2"]) == message
    plan = ["plan", "--model", "tiny-llama", "--optimizer-state", "int8", "--nproc-per-node", "2"]
    assert _cli_error(capsys, plan) == message


def test_plan_and_bench_apply_the_rules_over_the_options_they_take(capsys):
    split = ["--master", "split", "--dtype", "float32"]
    assert _cli_error(capsys, ["plan", "--model", "tiny-llama", *split]).startswith("--master split stores")
    nvme = ["bench", "--model", "tiny-llama", "--offload-optimizer", "nvme"]
    assert _cli_error(capsys, nvme).startswith("--offload-optimizer nvme needs --nvme-dir PATH")
    # `slide plan --save-best` sizes the disk of a run that keeps its best checkpoint: no evaluation data there.
    assert {"save_best", "eval_data", "eval_fraction"} in [set(rule.options) for rule in CROSS_RULES]


def test_every_rule_reads_declared_options():
    names = {item.name for item in train_options()}
    for rule in CROSS_RULES:
        assert set(rule.options) <= names, rule
