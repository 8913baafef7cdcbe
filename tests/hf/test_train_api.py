"""`slide train` as users drive it: the Python API, `--resume DIR` alone, and `--report-to`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import slide_hf
from slide_hf.cli.main import main
from slide_hf.errors import UserError

RUN = ["--device", "cpu", "--dtype", "float32", "--seq-len", "32", "--batch-size", "2", "--lr", "3e-3"]


pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter


def _losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "eval_loss" not in r]


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_python_api_takes_paths_as_str_calls_back_and_returns_the_summary(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"document number {i} about sliding windows."}) + "\n" for i in range(40))
    )
    steps, evals = [], []
    summary = slide_hf.train(
        "tiny-llama",
        data=str(data),
        output=str(tmp_path / "run"),
        device="cpu",
        dtype="float32",
        seq_len=32,
        batch_size=2,
        steps=4,
        eval_fraction=0.1,
        eval_every=2,
        on_step=steps.append,
        on_eval=evals.append,
    )
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    assert summary.steps == 4 and summary.last_loss == steps[-1]["loss"]
    assert summary.model_dir == tmp_path / "run" / "model" and (summary.model_dir / "config.json").is_file()


def test_python_api_refuses_bad_options_with_the_cli_message(tmp_path):
    with pytest.raises(UserError, match=r"^lr= must be a finite number >= 0, got nan$"):
        slide_hf.train("tiny-llama", lr=float("nan"), output=tmp_path / "run")
    with pytest.raises(TypeError, match=r"^unknown option 'learning_rate'; did you mean 'lr'\?$"):
        slide_hf.train("tiny-llama", learning_rate=1e-3, output=tmp_path / "run")


def test_resume_with_one_flag_continues_bit_identically(tmp_path, capsys):
    """An uninterrupted 6-step run against the same run stopped at its step-3 checkpoint and resumed with
    `--resume DIR` alone (constant LR, so the schedule does not depend on where the run stops)."""
    schedule = ["--lr-schedule", "constant", "--grad-accum", "2", "--max-grad-norm", "0.05", "--seed", "7"]
    full = tmp_path / "full"
    assert main(["train", *RUN, *schedule, "--steps", "6", "--save-every", "3", "--output", str(full)]) == 0
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints/step-00000003", resumed / "checkpoints/step-00000003")
    capsys.readouterr()
    assert main(["train", "--resume", str(resumed)]) == 0, capsys.readouterr().err
    assert _losses(resumed) == _losses(full)[3:]
    want, got = _weights(full / "model"), _weights(resumed / "model")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--lr", "0.5", "--lr was 0.003 in the run at"),
        ("--batch-size", "4", "--batch-size was 2 in the run at"),
        ("--seq-len", "64", "--seq-len was 32 in the run at"),
        ("--model", "tiny-gemma2", "--model was 'tiny-llama' in the run at"),
    ],
)
def test_resume_refuses_an_unsafe_change_in_one_line(tmp_path, capsys, flag, value, message):
    run = tmp_path / "run"
    assert main(["train", *RUN, "--steps", "2", "--output", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "4", flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "now" in err[0]


def test_report_to_tensorboard_from_the_command_line(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert main(["train", *RUN, "--steps", "3", "--report-to", "tensorboard", "--output", str(run)]) == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(_losses(run))


def test_api_messages_name_keywords_where_the_cli_names_flags(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(UserError) as error:
        slide_hf.train("tiny-llama", output=run, device="cpu", steps=1)
    message = str(error.value)
    assert f"resume='{run}'" in message and "overwrite=" in message and "output=" in message
    assert "--" not in message
    with pytest.raises(UserError, match=r"^min_lr_ratio= must be a finite number in \[0, 1\), got 1.5$"):
        slide_hf.train("tiny-llama", min_lr_ratio=1.5, output=tmp_path / "other")
    not_a_dir = tmp_path / "tok.txt"
    not_a_dir.write_text("")
    with pytest.raises(UserError, match=r"^tokenizer='.*tok.txt' is not a directory$"):
        slide_hf.train("tiny-llama", tokenizer=not_a_dir, output=tmp_path / "third", device="cpu")
    with pytest.raises(UserError, match=r"^eval_fraction= 0.01 holds out none of the 14 record\(s\) of "):
        slide_hf.train("tiny-llama", eval_fraction=0.01, output=tmp_path / "fourth", device="cpu", steps=1)
    # The command line, after an API call in the same process, still names flags.
    assert main(["train", *RUN, "--steps", "1", "--output", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"--resume {run}" in err and "--overwrite" in err and "resume=" not in err


def test_resume_compares_the_lr_the_run_resolved_not_none(tmp_path, capsys):
    """A run without --lr trains a preset at 1e-3 and saves that number: resuming with --lr 1e-3 is the
    same run, and another value is named against 0.001, never None."""
    run = tmp_path / "run"
    no_lr = [arg for arg in RUN if arg not in ("--lr", "3e-3")]
    assert main(["train", *no_lr, "--steps", "2", "--output", str(run)]) == 0
    assert json.loads((run / "options.json").read_text())["lr"] == 1e-3
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "3", "--lr", "1e-3"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "4", "--lr", "2e-3"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--lr was 0.001 in the run at" in line and "is 0.002 now" in line
