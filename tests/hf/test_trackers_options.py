"""`--report-to none`, `--run-name`, `--wandb-project` and ``WANDB_DIR``, and a tracker package that is
missing refused before the run reads its data. Tracker packages are stand-ins that record their calls."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from slide_hf.cli.main import main
from slide_hf.errors import UserError
from slide_hf.options import TrainConfig, toml_options
from slide_hf.trackers import check_trackers, open_trackers

TRAIN = ["train", "--device", "cpu", "--dtype", "float32", "--steps", "2", "--seq-len", "32"]
DATA_CACHE = ".data-cache"


@pytest.fixture
def wandb_calls(monkeypatch) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []

    class Run:
        def log(self, values: dict[str, float], step: int) -> None:
            calls.append(("log", step, dict(values)))

        def finish(self) -> None:
            calls.append(("finish",))

    def init(**kwargs: Any) -> Run:
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    return calls


@pytest.mark.parametrize("given", ["none", ["none"], ("none",), " none "])
def test_report_to_none_is_no_tracker(given: Any) -> None:
    assert TrainConfig(report_to=given).report_to == ()


def test_report_to_none_from_a_toml_file(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('report_to = ["none"]\n')
    assert TrainConfig(**toml_options(config)).report_to == ()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"report_to": "none,wandb"}, "--report-to none,wandb: none means no tracker; give it alone"),
        ({"report_to": 3}, "--report-to must be tracker names"),
        ({"run_name": "  "}, "--run-name must be non-empty text"),
        ({"wandb_project": ""}, "--wandb-project must be non-empty text"),
    ],
)
def test_bad_reporting_options_are_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match="^" + message):
        TrainConfig(**values)


def test_wandb_takes_the_project_and_the_run_name(tmp_path: Path, wandb_calls, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")
    options = {"run_name": "lr-sweep-3", "wandb_project": "chat-sft"}
    for tracker in open_trackers(("wandb",), tmp_path, options):
        tracker.close()
    init = wandb_calls[0][1]
    assert (init["project"], init["name"], init["dir"]) == ("chat-sft", "lr-sweep-3", str(tmp_path))


def test_wandb_defaults_to_the_environment_then_the_run_directory(tmp_path: Path, wandb_calls, monkeypatch) -> None:
    for tracker in open_trackers(("wandb",), tmp_path / "run-7", {}):
        tracker.close()
    monkeypatch.setenv("WANDB_PROJECT", "team")
    for tracker in open_trackers(("wandb",), tmp_path / "run-8", {"run_name": None, "wandb_project": None}):
        tracker.close()
    first, second = (call[1] for call in wandb_calls if call[0] == "init")
    assert (first["project"], first["name"]) == ("slideformer", "run-7")
    assert (second["project"], second["name"]) == ("team", "run-8")


def test_wandb_dir_is_honoured(tmp_path: Path, wandb_calls, monkeypatch) -> None:
    """W&B reads ``WANDB_DIR`` itself when no ``dir`` is passed; passing the run directory would override it."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))
    for tracker in open_trackers(("wandb",), tmp_path / "run", {}):
        tracker.close()
    assert "dir" not in wandb_calls[0][1]


def test_mlflow_takes_the_run_name(tmp_path: Path, monkeypatch) -> None:
    started: list[str] = []
    module = types.SimpleNamespace(
        set_tracking_uri=lambda uri: None,
        get_tracking_uri=lambda: "sqlite:///x.db",
        start_run=lambda run_name: started.append(run_name),
        log_params=lambda params: None,
        end_run=lambda: None,
    )
    monkeypatch.setitem(sys.modules, "mlflow", module)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")
    for options in ({"run_name": "baseline"}, {}):
        for tracker in open_trackers(("mlflow",), tmp_path / "run-1", options):
            tracker.close()
    assert started == ["baseline", "run-1"]


def test_check_trackers_refuses_a_missing_package(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # the import fails
    check_trackers(())
    with pytest.raises(UserError, match=r"^--report-to mlflow needs the mlflow package: pip install mlflow"):
        check_trackers(("mlflow",))


def test_a_missing_tracker_is_refused_before_the_data_is_read(tmp_path: Path, monkeypatch, capsys, torch_kernels):
    monkeypatch.setitem(sys.modules, "wandb", None)  # the import fails
    run = tmp_path / "run"
    assert main([*TRAIN, "--report-to", "tensorboard,wandb", "--output", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "slide train: error: --report-to wandb needs the wandb package: pip install wandb (or pip install "
        "'slide-hf[wandb]')"
    ]
    assert not (run / DATA_CACHE).exists() and not (run / "tensorboard").exists()


def test_a_run_reports_under_its_name_and_project(tmp_path: Path, wandb_calls, torch_kernels) -> None:
    run = tmp_path / "run"
    argv = [*TRAIN, "--output", str(run), "--report-to", "wandb", "--run-name", "first", "--wandb-project", "p"]
    assert main(argv) == 0
    init = wandb_calls[0][1]
    assert (init["project"], init["name"]) == ("p", "first")
    assert init["config"]["run_name"] == "first" and init["config"]["wandb_project"] == "p"
    assert [call[1] for call in wandb_calls if call[0] == "log"] == [1, 2]
    # A resume may rename the run, or stop reporting: both are how it reports, not what it trains.
    wandb_calls.clear()
    assert main(["train", "--resume", str(run), "--steps", "3", "--run-name", "second"]) == 0
    assert wandb_calls[0][1]["name"] == "second"
    wandb_calls.clear()
    assert main(["train", "--resume", str(run), "--steps", "4", "--report-to", "none"]) == 0
    assert wandb_calls == []
