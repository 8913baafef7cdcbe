"""The preference options (`--objective`, `--beta`, `--gamma`, `--dpo-loss`, `--label-smoothing`,
`--ref-model`): each refused in one line where it would do nothing, the same line from flags, a TOML file
and ``slide_hf.train``; their defaults as docs/preference.md states them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_options_schema import _cli_error, _flags, _toml

from slide_hf.api import train_config
from slide_hf.errors import UserError
from slide_hf.options import TrainConfig

CASES: dict[str, tuple[dict[str, Any], str]] = {
    "beta without a preference objective": ({"beta": 0.2}, "--beta acts only with --objective dpo or"),
    "gamma beside dpo": ({"objective": "dpo", "gamma": 1.0}, "--gamma acts only with --objective simpo"),
    "dpo loss beside simpo": ({"objective": "simpo", "dpo_loss": "ipo"}, "--dpo-loss acts only with --objective dpo"),
    "ref model beside simpo": ({"objective": "simpo", "ref_model": "ref"}, "--ref-model acts only with"),
    "smoothing beside sft": ({"label_smoothing": 0.1}, "--label-smoothing acts only with"),
    "smoothing beside ipo": (
        {"objective": "dpo", "dpo_loss": "ipo", "label_smoothing": 0.1},
        "--label-smoothing smooths the sigmoid loss",
    ),
    "smoothing of a half": ({"objective": "dpo", "label_smoothing": 0.5}, "--label-smoothing must be"),
    "beta of zero": ({"objective": "dpo", "beta": 0.0}, "--beta must be"),
    "unknown objective": ({"objective": "orpo"}, "--objective must be"),
    "inputs trained": ({"objective": "simpo", "train_on_inputs": True}, "--train-on-inputs does not run with"),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_rule_fires_identically_from_flags_toml_and_api(case: str, tmp_path: Path, capsys: Any) -> None:
    options, expected = CASES[case]
    with pytest.raises(UserError) as from_api:
        train_config(**options)
    message = str(from_api.value)
    assert expected in message
    assert _cli_error(capsys, ["train", *_flags(options)]) == message
    config = tmp_path / "run.toml"
    config.write_text(_toml(options))
    assert _cli_error(capsys, ["train", "--config", str(config)]) == message


def test_defaults() -> None:
    assert TrainConfig().objective == "sft" and not TrainConfig().preference
    dpo, simpo = TrainConfig(objective="dpo"), TrainConfig(objective="simpo")
    assert dpo.resolved_beta == 0.1 and simpo.resolved_beta == 2.0 and simpo.gamma == 0.5
    assert dpo.dpo_loss == "sigmoid" and dpo.label_smoothing == 0.0 and dpo.ref_model is None
    assert TrainConfig(objective="simpo", beta=1.5).resolved_beta == 1.5


def test_preference_runs_data_parallel() -> None:
    """The objectives run on several processes (docs/preference.md, "Data parallel"): no rule refuses them."""
    for objective in ("dpo", "simpo"):
        TrainConfig(objective=objective).validate(2)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"objective": "dpo", "gamma": 0.5}, "--gamma 0.5 acts only with --objective simpo, got --objective dpo"),
        ({"gamma": 0.5}, "--gamma 0.5 acts only with --objective simpo, got --objective sft"),
        ({"objective": "simpo", "dpo_loss": "sigmoid"}, "--dpo-loss sigmoid acts only with --objective dpo, got"),
    ],
)
def test_an_option_written_at_its_default_beside_another_objective_is_refused(
    options: dict[str, Any], expected: str, tmp_path: Path, capsys: Any
) -> None:
    """``--gamma 0.5`` (SimPO's default) beside DPO trained as if it were not there: the value rule saw the
    default only. What the user wrote is checked too, from flags and from a TOML file."""
    message = _cli_error(capsys, ["train", *_flags(options)])
    assert expected in message
    config = tmp_path / "run.toml"
    config.write_text(_toml(options))
    assert _cli_error(capsys, ["train", "--config", str(config)]) == message
