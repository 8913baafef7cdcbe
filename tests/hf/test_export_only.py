"""`--keep-checkpoints 0`, export only (Note [Export only] in slide_hf/run_export.py): the run ends with the
model exported from the training state and no checkpoint; a stop keeps the checkpoint it writes until a
resumed run exports; an export that cannot finish (a full disk, SIGTERM) writes a checkpoint in its place,
and says so in one line when that cannot be written either. The options that write or keep checkpoints are
refused beside it, and `slide plan` and the output-disk check price the export alone."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch
from test_train_faults import terminate_while_exporting

from slide_core.checkpoint import list_checkpoints, writer
from slide_hf.cli.main import main
from slide_hf.errors import UserError
from slide_hf.planner import output_disk as disk
from slide_hf.planner.output_disk import OutputDisk, check_output_disk, checkpoints_at_once, output_disk

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter

RUN = ("--device", "cpu", "--dtype", "float32", "--steps", "4", "--seq-len", "16", "--batch-size", "2", "--seed", "5")
"""tiny-llama on the bundled text, 4 steps in fp32 (tests/hf/test_train_faults.py's run): a resumed or
re-exported run equals an uninterrupted one bit for bit."""

EXPORT_ONLY = ("--keep-checkpoints", "0")
NO_SPACE = "Error while serializing: I/O error: No space left on device (os error 28)"


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def _same_model(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return bool(wa) and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def _checkpoints(run: Path) -> list[str]:
    return [p.name for p in list_checkpoints(run / "checkpoints")] if (run / "checkpoints").is_dir() else []


def _no_leftovers(run: Path) -> None:
    assert not list(run.glob(".model.tmp-*")) and not list(run.glob("checkpoints/.tmp-*"))


def _full_disk(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError(NO_SPACE)


def _no_space(*args, **kwargs):
    """A checkpoint's shard that the disk refuses (what slide_core.checkpoint.writer._write_shard writes)."""
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, torch_kernels_module: None) -> Path:
    """The model of the uninterrupted run with the default retention: checkpoint first, then export."""
    run = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", "--output", str(run), *RUN]) == 0
    assert _checkpoints(run) == ["step-00000004"]  # the test means something: the default keeps one
    assert "checkpoint written" in (run / "train.log").read_text()
    return run / "model"


@pytest.fixture(scope="module")
def export_only(tmp_path_factory: pytest.TempPathFactory, torch_kernels_module: None) -> Path:
    """The run directory of the same run with --keep-checkpoints 0."""
    run = tmp_path_factory.mktemp("export-only") / "run"
    assert main(["train", "--output", str(run), *RUN, *EXPORT_ONLY]) == 0
    return run


# ---- the run's end -------------------------------------------------------------------------------------------


def test_export_only_writes_the_model_of_a_checkpointed_run_and_keeps_no_checkpoint(
    export_only: Path, reference: Path
) -> None:
    assert _same_model(export_only / "model", reference)
    assert not list(export_only.glob("checkpoints/step-*")) and not list(export_only.glob("**/step-*"))
    _no_leftovers(export_only)
    assert json.loads((export_only / "model/slide-export.json").read_text())["step"] == 4
    assert (export_only / "model/tokenizer.json").is_file() and (export_only / "model/config.json").is_file()
    assert json.loads((export_only / "options.json").read_text())["keep_checkpoints"] == 0
    log = (export_only / "train.log").read_text()
    assert "checkpoint written" not in log  # none was ever written, not one written and deleted
    assert "model of step 4 written from the training state; no checkpoint kept (--keep-checkpoints 0)" in log


@pytest.mark.timeout(180)
def test_sigterm_mid_run_keeps_its_checkpoint_until_the_resumed_run_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], export_only: Path
) -> None:
    from slide_core.engine import Engine

    real_step = Engine.step

    def step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        if result.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's SIGTERM during step 2
        return result

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(Engine, "step", step)
        assert main(["train", "--output", str(run), *RUN, *EXPORT_ONLY]) == 143
    line = _one_line(capsys)
    assert line == (
        f"slide train: stopped by SIGTERM after step 2; its checkpoint is saved; continue with "
        f"`slide train --resume {run}`"
    )
    assert _checkpoints(run) == ["step-00000002"]  # --keep-checkpoints 0 does not prune the one to resume from
    assert not (run / "model").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    assert main(["train", "--resume", str(run)]) == 0
    capsys.readouterr()
    assert _same_model(run / "model", export_only / "model")
    assert _checkpoints(run) == []  # the run ends with the export alone
    _no_leftovers(run)
    log = (run / "train.log").read_text()
    assert "deleted step-00000002: --keep-checkpoints 0 keeps no checkpoint once the model is written" in log


@pytest.mark.timeout(180)
def test_a_stop_at_the_last_step_resumes_into_the_export_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], export_only: Path
) -> None:
    """SIGTERM in the last step: its checkpoint is the run's end state. The resume the line names has
    nothing left to train; it writes the model and, --keep-checkpoints 0, keeps no checkpoint either."""
    from slide_core.engine import Engine

    real_step = Engine.step

    def step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        if result.step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(Engine, "step", step)
        assert main(["train", "--output", str(run), *RUN, *EXPORT_ONLY]) == 143
    assert "stopped by SIGTERM after step 4" in _one_line(capsys)
    assert _checkpoints(run) == ["step-00000004"] and not (run / "model").exists()
    assert main(["train", "--resume", str(run)]) == 0
    assert f"nothing left to train in {run}" in capsys.readouterr().out
    assert _same_model(run / "model", export_only / "model")
    assert _checkpoints(run) == []
    _no_leftovers(run)


@pytest.mark.timeout(180)
def test_full_disk_during_the_export_writes_a_checkpoint_in_its_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], reference: Path
) -> None:
    import slide_hf.export as export_module

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(export_module, "save_file", _full_disk)
        assert main(["train", "--output", str(run), *RUN, *EXPORT_ONLY]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"slide train: error: cannot write the model to {run / 'model'}: No space left on device")
    assert line.endswith(
        f"; the checkpoint of step 4 is kept: write the model with `slide export {run} {run / 'model'}`"
    )
    assert _checkpoints(run) == ["step-00000004"]
    assert not (run / "model").exists()
    _no_leftovers(run)
    # The command the line gives finishes the job, with the model of the uninterrupted run.
    assert main(["export", str(run), str(run / "model")]) == 0
    capsys.readouterr()
    assert _same_model(run / "model", reference)
    assert (run / "model/tokenizer.json").is_file()


@pytest.mark.timeout(180)
def test_a_checkpoint_that_cannot_be_written_in_the_exports_place_either_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import slide_hf.export as export_module

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(export_module, "save_file", _full_disk)
        patch.setattr(writer, "_write_shard", _no_space)
        assert main(["train", "--output", str(run), *RUN, *EXPORT_ONLY]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"slide train: error: cannot write the model to {run / 'model'}: No space left on device")
    assert "; the checkpoint of step 4 could not be written in its place either (" in line
    assert f"cannot write checkpoint {run / 'checkpoints/step-00000004'}: No space left on device" in line
    assert line.endswith("): retrain")
    assert "is kept: write the model" not in line  # no command that cannot work
    assert _checkpoints(run) == [] and not (run / "model").exists()
    _no_leftovers(run)


@pytest.mark.timeout(180)
def test_sigterm_during_the_export_writes_a_checkpoint_in_its_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], reference: Path
) -> None:
    import slide_hf.export as export_module

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        terminate_while_exporting(patch)
        assert main(["train", "--output", str(run), *RUN, *EXPORT_ONLY]) == 143
    line = _one_line(capsys)
    assert "error" not in line
    assert line == (
        f"slide train: stopped by SIGTERM during the export; the checkpoint of step 4 is kept: write the model "
        f"with `slide export {run} {run / 'model'}`"
    )
    assert _checkpoints(run) == ["step-00000004"]
    assert not (run / "model").exists()
    _no_leftovers(run)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the run's handlers are gone again
    # Resumed onto a full disk: the checkpoint on disk is the one kept, not written again (it could not be).
    with monkeypatch.context() as patch:
        patch.setattr(export_module, "save_file", _full_disk)
        patch.setattr(writer, "_write_shard", _no_space)
        assert main(["train", "--resume", str(run)]) == 2
    assert _one_line(capsys).endswith(
        f"; the checkpoint of step 4 is kept: write the model with `slide export {run} {run / 'model'}`"
    )
    assert _checkpoints(run) == ["step-00000004"] and not (run / "model").exists()
    # Resumed again, the run ends as an uninterrupted one: the model, and no checkpoint.
    assert main(["train", "--resume", str(run)]) == 0
    assert f"nothing left to train in {run}" in capsys.readouterr().out
    assert _same_model(run / "model", reference)
    assert _checkpoints(run) == []
    _no_leftovers(run)


# ---- the options ---------------------------------------------------------------------------------------------


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0].removeprefix(f"slide {argv[0]}: error: ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--nproc-per-node", "2"),
            "--keep-checkpoints 0 does not run with data parallel (2 processes) yet: the export from the "
            "training state is one process's",
        ),
        (
            ("--save-every", "2"),
            "--save-every writes checkpoints mid-run, and --keep-checkpoints 0 keeps none; give one",
        ),
        (
            ("--save-best", "--eval-fraction", "0.1"),
            "--save-best keeps the best checkpoint, and --keep-checkpoints 0 keeps none; give one",
        ),
        (
            ("--save-delete-first",),
            "--save-delete-first makes room for the next checkpoint, and --keep-checkpoints 0 keeps none; give one",
        ),
        (
            ("--save-async",),
            "--save-async writes checkpoints in the background, and --keep-checkpoints 0 keeps none; give one",
        ),
    ],
    ids=["data parallel", "save every", "save best", "save delete first", "save async"],
)
def test_options_that_write_or_keep_checkpoints_are_refused_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    run = tmp_path / "run"
    assert _refused(capsys, ["train", "--output", str(run), *RUN, *EXPORT_ONLY, *argv]) == message
    assert not run.exists()
    # The same line from a TOML file, and none without --keep-checkpoints 0 (one process).
    config = tmp_path / "run.toml"
    config.write_text("keep_checkpoints = 0\n")
    assert _refused(capsys, ["train", "--config", str(config), "--output", str(run), *RUN, *argv]) == message


def test_the_python_api_refuses_the_same_combinations() -> None:
    from slide_hf.api import train_config

    cfg = train_config(keep_checkpoints=0)
    cfg.validate(1)
    with pytest.raises(UserError, match=r"does not run with data parallel \(2 processes\)"):
        cfg.validate(2)
    with pytest.raises(UserError, match="keeps none; give one"):
        train_config(keep_checkpoints=0, save_every=2)
    for name in ("save_every", "save_delete_first", "save_async"):  # each allowed where checkpoints are kept
        train_config(keep_checkpoints=1, **{name: 2 if name == "save_every" else True}).validate(1)


def test_a_negative_keep_checkpoints_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = ["train", "--output", str(run), *RUN, "--keep-checkpoints", "-1"]
    assert _refused(capsys, argv) == "--keep-checkpoints must be an integer in [0, 1000000], got -1"
    assert not run.exists()


# ---- the output disk -----------------------------------------------------------------------------------------

CHECKPOINT, EXPORT = 12_000, 2_000


def test_export_only_prices_the_export_alone() -> None:
    assert checkpoints_at_once(0, False) == 0 and checkpoints_at_once(0, False, delete_first=True) == 0
    assert checkpoints_at_once(1, False) == 2  # unchanged beside it
    need = output_disk([1000, 2000], [], params=1000, export_itemsize=2, keep_checkpoints=0, save_best=False)
    assert need.export_only and need.checkpoints_at_once == 0 and need.checkpoints_bytes == 0
    assert need.checkpoint_bytes == 4 * 3000  # what a stop writes, still priced
    assert need.minimum_bytes == need.total_bytes == need.export_bytes == 2000
    one = output_disk([1000, 2000], [], params=1000, export_itemsize=2, keep_checkpoints=1, save_best=False)
    assert not one.export_only and one.minimum_bytes == 12_000 + 2000
    assert need.to_dict()["checkpoints_bytes"] == 0 and need.to_dict()["total_bytes"] == 2000


def _free(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    monkeypatch.setattr(disk, "free_bytes", lambda directory: nbytes)


def test_check_output_disk_refuses_no_room_for_the_export_and_warns_without_room_for_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    need = OutputDisk(checkpoint_bytes=CHECKPOINT, checkpoints_at_once=0, export_bytes=EXPORT)
    # Room for the export but not for a checkpoint beside it: a warning, and the run goes on.
    _free(monkeypatch, EXPORT)
    with caplog.at_level(logging.WARNING, logger="slide.train"):
        check_output_disk(tmp_path, need)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "enough for the" in warning and "not for the" in warning and "a stop (SIGINT/SIGTERM)" in warning
    # One byte short of a checkpoint and the export: the default retention refuses the disk, this warns.
    _free(monkeypatch, CHECKPOINT + EXPORT - 1)
    with pytest.raises(UserError, match="one checkpoint takes"):
        check_output_disk(tmp_path, OutputDisk(CHECKPOINT, 2, EXPORT))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slide.train"):
        check_output_disk(tmp_path, need)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "not for the" in warning
    # Room for both: silent.
    caplog.clear()
    _free(monkeypatch, CHECKPOINT + EXPORT)
    with caplog.at_level(logging.WARNING, logger="slide.train"):
        check_output_disk(tmp_path, need)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # Less than the export: one line naming it and --output.
    _free(monkeypatch, EXPORT - 1)
    with pytest.raises(UserError) as refused:
        check_output_disk(tmp_path, need)
    message = str(refused.value)
    assert "\n" not in message and "the exported model takes" in message and "--output" in message
    assert "checkpoint" not in message
    # Weights-only saves are kept too: the export and them must fit.
    weights = OutputDisk(CHECKPOINT, 0, EXPORT, weights_saves=3)
    _free(monkeypatch, 4 * EXPORT - 1)
    with pytest.raises(UserError, match="and 3 weights-only saves"):
        check_output_disk(tmp_path, weights)
    _free(monkeypatch, 4 * EXPORT)
    check_output_disk(tmp_path, weights)


def test_plan_says_no_checkpoint_is_kept_at_the_end(
    slide, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from slide_hf import setup

    monkeypatch.setattr(setup, "fused_loss_available", lambda: True)  # as tests/hf/test_cli_plan.py plans
    base = ("plan", "--model", "tiny-llama", "--seq-len", "256")
    status, out, err = slide(*base, *EXPORT_ONLY)
    assert status == 0, err
    (row,) = [line for line in out.splitlines() if line.strip().startswith("checkpoints")]
    assert "none at the end (--keep-checkpoints 0); a stop writes one of" in row
    status, out, err = slide(*base)
    assert status == 0, err
    assert "none at the end" not in out and "3 at once" in out
    planned = json.loads(slide(*base, *EXPORT_ONLY, "--json")[1])["output_disk"]
    assert planned["checkpoints_at_once"] == 0 and planned["checkpoint_bytes"] > 0
    assert planned["total_bytes"] == planned["export_bytes"]
    status, _, err = slide(*base, *EXPORT_ONLY, "--nproc-per-node", "2")
    assert status == 2 and err.count("\n") == 1 and "--keep-checkpoints 0 does not run with data parallel" in err
