"""slide_hf.run_log and slide_hf.trackers: the files every run leaves, and the optional trackers."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path

import pytest

from slide_hf.errors import UserError
from slide_hf.run_log import RunLog
from slide_hf.trackers import MLflowTracker, open_trackers

OPTIONS = {"model": "tiny-llama", "lr": 0.001, "report_to": []}


def _record(step: int, **extra) -> dict:
    return {"step": step, "loss": 2.0 / step, "lr": 1e-3, "skipped": False, **extra}


def test_a_run_writes_options_log_and_metrics_by_default(tmp_path):
    with RunLog(tmp_path, OPTIONS) as run_log:
        run_log.start(0)
        logging.getLogger("slide.train").info("hello from the run")
        for step in (1, 2):
            run_log.record(_record(step))
    assert json.loads((tmp_path / "options.json").read_text()) == OPTIONS
    assert "hello from the run" in (tmp_path / "train.log").read_text()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_non_finite_values_are_written_as_null_json(tmp_path):
    with RunLog(tmp_path, OPTIONS) as run_log:
        run_log.start(0)
        run_log.record(_record(1, grad_norm=float("nan")))
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["grad_norm"] is None


def test_a_resumed_run_drops_the_records_it_is_about_to_redo(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(_record(s)) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    with RunLog(tmp_path, OPTIONS) as run_log:
        run_log.start(2)
        run_log.record(_record(3))
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]


def test_metrics_pointing_at_an_input_is_refused(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "keep me"}\n')
    with pytest.raises(UserError, match="is an input of this run"):
        RunLog(tmp_path, OPTIONS, metrics=tmp_path / "." / "train.jsonl", inputs=(data,))
    assert data.read_text() == '{"text": "keep me"}\n'


def test_a_failing_metrics_write_warns_once_and_training_goes_on(tmp_path, caplog):
    class FullDisk:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    with RunLog(tmp_path, OPTIONS) as run_log:
        run_log.start(0)
        run_log._metrics = FullDisk()
        with caplog.at_level(logging.WARNING, logger="slide.train"):
            for step in (1, 2, 3):
                run_log.record(_record(step))
    warnings = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]


def test_unwritable_output_is_one_line(tmp_path):
    missing = tmp_path / "gone"
    with pytest.raises(UserError, match="cannot write"):
        RunLog(missing, OPTIONS).__enter__()


def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with RunLog(tmp_path, OPTIONS, report_to=("tensorboard",)) as run_log:
        run_log.start(0)
        for step in (1, 2, 3):
            run_log.record(_record(step, eval_loss=1.5))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert events.Scalars("loss")[1].value == pytest.approx(1.0)
    assert "skipped" not in events.Tags()["scalars"]  # booleans are not plotted


class _Recorder:
    """A stand-in for a tracker package, recording what the adapter asks of it."""

    def __init__(self):
        self.calls: list[tuple] = []


@pytest.fixture
def fake_wandb(monkeypatch):
    recorder = _Recorder()

    class Run:
        def log(self, values, step):
            recorder.calls.append(("log", step, dict(values)))

        def finish(self):
            recorder.calls.append(("finish",))

    def init(**kwargs):
        recorder.calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return recorder


@pytest.fixture
def fake_mlflow(monkeypatch):
    recorder = _Recorder()
    module = types.SimpleNamespace(
        set_tracking_uri=lambda uri: recorder.calls.append(("uri", uri)),
        get_tracking_uri=lambda: next(c[1] for c in reversed(recorder.calls) if c[0] == "uri"),
        start_run=lambda run_name: recorder.calls.append(("start", run_name)),
        log_params=lambda params: recorder.calls.append(("params", params)),
        log_metrics=lambda values, step: recorder.calls.append(("log", step, dict(values))),
        end_run=lambda: recorder.calls.append(("end",)),
    )
    monkeypatch.setitem(sys.modules, "mlflow", module)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return recorder


def test_wandb_adapter_logs_numeric_fields_per_step(tmp_path, fake_wandb):
    with RunLog(tmp_path, OPTIONS, report_to=("wandb",)) as run_log:
        run_log.start(0)
        run_log.record(_record(1))
    init, log, finish = fake_wandb.calls
    assert init[1]["config"] == OPTIONS and init[1]["dir"] == str(tmp_path)
    assert log == ("log", 1, {"loss": 2.0, "lr": 1e-3})
    assert finish == ("finish",)


def test_mlflow_adapter_uses_a_local_store_by_default(tmp_path, fake_mlflow):
    with RunLog(tmp_path, OPTIONS, report_to=("mlflow",)) as run_log:
        run_log.start(0)
        run_log.record(_record(2))
    calls = dict((c[0], c[1:]) for c in fake_mlflow.calls)
    assert calls["uri"][0] == MLflowTracker.local_uri(tmp_path)
    assert str(tmp_path.resolve()) in calls["uri"][0]  # the store stays in the run directory
    assert calls["params"][0]["lr"] == "0.001"
    assert calls["log"] == (2, {"loss": 1.0, "lr": 1e-3})
    assert "end" in calls


def test_a_missing_tracker_package_is_one_line_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(UserError, match=r"^--report-to wandb needs the wandb package: pip install wandb"):
        open_trackers(("wandb",), tmp_path, OPTIONS)


def test_a_tracker_failing_during_training_warns_once(tmp_path, monkeypatch, caplog):
    class Broken:
        def log(self, values, step):
            raise ConnectionError("server went away")

        def finish(self):
            pass

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: Broken()))
    with caplog.at_level(logging.WARNING, logger="slide.train"), RunLog(tmp_path, OPTIONS, report_to=("wandb",)) as log:
        log.start(0)
        for step in (1, 2):
            log.record(_record(step))
    assert sum("wandb tracker" in r.getMessage() for r in caplog.records) == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_metrics_path_elsewhere(tmp_path):
    target = tmp_path / "logs" / "m.jsonl"
    with RunLog(tmp_path, OPTIONS, metrics=target) as run_log:
        run_log.start(0)
        run_log.record(_record(1))
    assert target.is_file() and not (tmp_path / "metrics.jsonl").exists()
    assert isinstance(Path(target), Path)


def test_wandb_offline_run_for_real(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with RunLog(tmp_path, OPTIONS, report_to=("wandb",)) as run_log:
        run_log.start(0)
        for step in (1, 2):
            run_log.record(_record(step))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_mlflow_local_run_for_real(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with RunLog(tmp_path, OPTIONS, report_to=("mlflow",)) as run_log:
        run_log.start(0)
        for step in (1, 2, 3):
            run_log.record(_record(step))
    client = mlflow.tracking.MlflowClient(tracking_uri=MLflowTracker.local_uri(tmp_path))
    (run,) = client.search_runs(experiment_ids=["0"])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3]
    assert run.data.params["lr"] == "0.001"
