"""slide_hf/options: each option declared once reaches every parser, the TOML file, the Python API and the engine's
options it claims, and each cross-option rule fires with the same line whichever way the options came in."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

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
    command_options,
    engine_options,
    toml_options,
    train_options,
)
from slide_hf.options.schema import declared
from slide_hf.setup import RunOptions
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
    schedule_of = {"decay_fraction": "wsd", "decay_shape": "wsd", "lr_cycles": "cosine_with_restarts"}
    schedule_of |= {"lr_power": "polynomial", "lr_end": "polynomial", "lr_timescale": "inverse_sqrt"}
    companion = {"lr_schedule": schedule_of[item.name]} if item.name in schedule_of else {}  # one schedule's alone
    companion |= (
        {"objective": {"gamma": "simpo", "dpo_loss": "dpo"}[item.name]} if item.name in ("gamma", "dpo_loss") else {}
    )
    cfg = train_config(**{item.name: item.default}, **companion)
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


# ---- the engine's options and `slide bench`'s: generated from the declarations -------------------------------

DERIVED_RUN_FIELDS = {"report_grad_norm", "packed_rows"}
"""RunOptions fields that are no option: the run derives them (or `slide bench --no-grad-norm` chooses)."""
BENCH_READS = {"model", "steps"}
"""Options `slide bench` takes that the engine does not read: the benchmark reads them itself."""

ENGINE_SAMPLES: dict[str, Any] = {
    "device": "cpu",
    "gpu_memory": "3GiB",
    "optimizer": "torch",
    "optimizer_state": "bf16",
    "master": "fp32",
    "offload_optimizer": "nvme",
    "nvme_dir": "scratch",
    "nvme_fraction": 0.5,
    "offload_activations": "nvme",
    "block_slots": 3,
    "seq_tile": 128,
    "dtype": "float32",
    "batch_size": 3,
    "seq_len": 64,
    "grad_accum": 2,
    "max_grad_norm": 0.5,
    "update_placement": "auto",
    "objective": "simpo",
}
"""A value other than the default for every option the engine reads (valid together)."""
ENGINE_EXPECTED: dict[str, Any] = {
    "update_placement": "auto",
    "gpu_memory_bytes": 3 << 30,
    "optimizer": "torch-adamw",
    "nvme_dir": Path("scratch"),
    "compute_dtype": torch.float32,
}
"""The engine's value where it is not the sample itself: converted, or resolved to its canonical spelling."""


def test_every_option_the_engine_reads_is_a_run_options_field_and_nothing_else_is():
    run_fields = {field.name for field in dataclasses.fields(RunOptions)}
    engine_names = [item.engine_name for item in engine_options()]
    assert len(engine_names) == len(set(engine_names))  # no two options land on one field
    assert run_fields == set(engine_names) | DERIVED_RUN_FIELDS
    # An option named as a RunOptions field is one the engine reads: declared with engine=, not copied by hand.
    assert not {item.name for item in train_options() if item.engine_name is None} & run_fields


def test_run_options_carry_every_declared_engine_option_converted_as_declared():
    assert set(ENGINE_SAMPLES) == {item.name for item in engine_options()}  # a new engine option needs a sample
    options = RunOptions.from_config(train_config(**ENGINE_SAMPLES))
    defaults = RunOptions.from_config(train_config(seq_len=32))
    for item in engine_options():
        assert item.engine_name is not None
        expected = ENGINE_EXPECTED.get(item.engine_name, ENGINE_SAMPLES[item.name])
        assert getattr(options, item.engine_name) == expected, item.name
        assert getattr(defaults, item.engine_name) != expected, item.name  # the sample is not the default


def test_run_options_report_the_grad_norm_only_where_it_costs_nothing_unless_told():
    assert RunOptions.from_config(train_config(seq_len=64)).report_grad_norm
    assert not RunOptions.from_config(train_config(seq_len=64, grad_accum=2)).report_grad_norm
    assert RunOptions.from_config(train_config(seq_len=64, grad_accum=2, max_grad_norm=1.0)).report_grad_norm
    assert not RunOptions.from_config(train_config(seq_len=64), report_grad_norm=False).report_grad_norm


def test_run_options_refuse_a_seq_len_not_yet_resolved():
    with pytest.raises(ValueError, match="seq_len resolved first"):
        RunOptions.from_config(train_config())


def test_bench_carries_every_option_it_takes_to_the_benchmark_and_its_engine(monkeypatch, tmp_path):
    import slide_hf.bench
    from slide_hf.cli import bench

    taken = command_options("bench")
    assert {item.name for item in taken if item.engine_name is None} == BENCH_READS
    samples = {"model": "tiny-llama", "steps": 5, **ENGINE_SAMPLES, "nvme_dir": tmp_path}
    argv = [arg for item in taken for arg in (item.flag, str(samples[item.name]))]
    ran: list[Any] = []
    monkeypatch.setattr(slide_hf.bench, "run_bench", lambda cfg: ran.append(cfg) or {})
    assert bench.run(_parser("bench").parse_args(argv)) == 0
    (cfg,) = ran
    engine = cfg.run_options()
    for item in taken:
        expected = item.normalised(samples[item.name])
        assert getattr(cfg.options, item.name) == (Path(expected) if item.name == "nvme_dir" else expected)
        if item.engine_name is not None:
            assert getattr(engine, item.engine_name) == item.engine_value(getattr(cfg.options, item.name))


# ---- `slide data`: its shared options are the schema's -----------------------------------------------------

DATA_OWN_FLAGS = {"-h", "--help", "--show", "--json"}
"""What `slide data` alone takes: how much to show, and in which format."""


def test_slide_data_takes_the_declared_data_options_and_only_its_own_besides():
    parser = _parser("data")
    declared_flags = {item.flag for item in command_options("data")}
    assert declared_flags >= {"--model", "--data", "--seq-len", "--no-packing", "--chat-template"}
    assert set(parser._option_string_actions) == declared_flags | DATA_OWN_FLAGS
    for item in command_options("data"):
        assert parser._option_string_actions[item.flag].help == item.help_for("data")


def test_slide_data_help_lists_the_declared_options(capsys):
    assert cli.main(["data", "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())  # help text wraps lines
    for item in command_options("data"):
        assert item.flag in shown
        assert " ".join(item.help_for("data").split()) in shown, item.name


def test_slide_data_checks_its_options_by_the_schemas_rules(capsys):
    assert _cli_error(capsys, ["data", "--seq-len", "1"]) == str(_refusal(seq_len=1))
    assert _cli_error(capsys, ["data", "--data-weights", "1"]).startswith("--data-weights gives 1 weight(s)")


def _refusal(**options: Any) -> UserError:
    with pytest.raises(UserError) as refused:
        train_config(**options)
    return refused.value
