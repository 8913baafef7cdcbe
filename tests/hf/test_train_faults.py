"""Faults during `slide train`: a CUDA OOM gives one clear line, nothing hangs, the last checkpoint stays."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from slide_core.checkpoint import CheckpointCorrupt, find_latest, list_checkpoints
from slide_hf.cli.main import main

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter


@pytest.mark.timeout(120)
def test_oom_names_the_allocation_and_the_plan_command(tmp_path: Path, monkeypatch, capsys) -> None:
    from slide_hf.adapters import base

    calls = {"n": 0}
    original = base.BlockUnit.forward

    def forward(self, params, x, inputs):
        calls["n"] += 1
        if calls["n"] > 40:  # a few steps in, after the first checkpoint
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.5 GiB"
            )
        return original(self, params, x, inputs)

    monkeypatch.setattr(base.BlockUnit, "forward", forward)
    output = tmp_path / "run"
    before = {t for t in threading.enumerate() if t.name.startswith("slide-")}
    began = time.monotonic()
    code = main(["train", "--output", str(output), "--steps", "6", "--seq-len", "32", "--save-every", "2"])
    assert code == 2
    assert time.monotonic() - began < 60
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert "GPU out of memory in step" in err[0] and "Tried to allocate 2.00 GiB" in err[0]
    assert "slide plan --model tiny-llama --batch-size 4 --seq-len 32" in err[0]
    assert list_checkpoints(output / "checkpoints"), "the checkpoint written before the fault is gone"
    assert find_latest(output).name.startswith("step-")
    time.sleep(0.5)
    left = {t for t in threading.enumerate() if t.name.startswith("slide-") and t.is_alive()} - before
    assert not left, f"threads left behind: {left}"


# ---- the end of a run: checkpoint first, then an export that fails cleanly -----------------------------

RUN = ("--device", "cpu", "--dtype", "float32", "--steps", "4", "--seq-len", "16", "--batch-size", "2", "--seed", "5")
"""tiny-llama on the bundled text, 4 steps in fp32: a resumed or re-exported run equals an uninterrupted one
bit for bit."""


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def _same_model(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, torch_kernels_module) -> Path:
    """The model of the uninterrupted run."""
    run = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", "--output", str(run), *RUN]) == 0
    return run / "model"


@pytest.mark.timeout(180)
def test_full_disk_during_the_final_export_keeps_a_checkpoint_to_export_from(
    tmp_path: Path, monkeypatch, capsys, reference: Path
) -> None:
    """The default --save-every 0 used to leave only config/ and tokenizer/ after a SafetensorError."""
    from safetensors import SafetensorError

    import slide_hf.export as export_module

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(export_module, "save_file", full_disk)
        assert main(["train", "--output", str(run), *RUN]) == 2
    line = _one_line(capsys)
    assert f"cannot write the model to {run / 'model'}: No space left on device" in line
    assert f"the checkpoint of step 4 is kept: write the model with `slide export {run} {run / 'model'}`" in line
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000004"]
    assert not (run / "model").exists() and not list(run.glob(".model.tmp-*"))
    # The command the line gives finishes the job, with the model of the uninterrupted run.
    assert main(["export", str(run), str(run / "model")]) == 0
    assert _same_model(run / "model", reference)
    assert (run / "model" / "tokenizer.json").is_file()


def terminate_while_exporting(patch: pytest.MonkeyPatch) -> None:
    """Within ``patch``: the scheduler's SIGTERM arrives as the export writes its first shard."""
    import slide_hf.export as export_module

    real = export_module.save_file

    def terminated_while_writing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    patch.setattr(export_module, "save_file", terminated_while_writing)


@pytest.mark.timeout(180)
def test_sigterm_during_the_final_export_stops_cleanly_and_resume_finishes(
    tmp_path: Path, monkeypatch, capsys, reference: Path
) -> None:
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        terminate_while_exporting(patch)
        assert main(["train", "--output", str(run), *RUN]) == 143
    line = _one_line(capsys)
    assert "error" not in line
    assert line.startswith("slide train: stopped by SIGTERM during the export; the checkpoint of step 4 is kept")
    assert not (run / "model").exists() and not list(run.glob(".model.tmp-*"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the run's handlers are gone again
    # Resuming the finished run writes its model and succeeds.
    assert main(["train", "--resume", str(run)]) == 0
    assert f"nothing left to train in {run}" in capsys.readouterr().out
    assert _same_model(run / "model", reference)


@pytest.mark.timeout(180)
def test_sigint_mid_run_exits_130_with_the_resume_command(tmp_path: Path, monkeypatch, capsys, reference) -> None:
    import os
    import signal

    from slide_core.engine import Engine

    real_step = Engine.step

    def step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        if result.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during step 2
        return result

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(Engine, "step", step)
        assert main(["train", "--output", str(run), *RUN]) == 130
    line = _one_line(capsys)
    assert line == (
        f"slide train: stopped by SIGINT after step 2; its checkpoint is saved; continue with "
        f"`slide train --resume {run}`"
    )
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000002"]
    assert main(["train", "--resume", str(run)]) == 0
    assert _same_model(run / "model", reference)


@pytest.mark.timeout(180)
def test_nan_weights_are_never_exported(tmp_path: Path, capsys) -> None:
    """A checkpoint whose master holds NaN (checksums valid): neither `slide export` nor the end of a resumed
    run writes a model, and the line names the tensor."""
    from slide_core.checkpoint import load_checkpoint, read_state, save_checkpoint

    run = tmp_path / "run"
    assert main(["train", "--output", str(run), *RUN, "--steps", "2"]) == 0
    capsys.readouterr()
    checkpoint = find_latest(run)
    state = read_state(checkpoint)
    arrays = {
        name: torch.empty(info["numel"], dtype=getattr(torch, info["dtype"])) for name, info in state["arrays"].items()
    }
    load_checkpoint(checkpoint, arrays)
    arrays["master"][5] = float("nan")  # inside the embedding, the first tensor of the model
    save_checkpoint(checkpoint.parent, state["step"], arrays, state["extra"])
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    line = _one_line(capsys)
    assert "model.embed_tokens.weight holds NaN or Inf values" in line and "Lower --lr" not in line
    assert not (tmp_path / "out").exists()
    assert main(["train", "--resume", str(run)]) == 2  # finished: straight to the export, which refuses
    line = _one_line(capsys)
    assert "model.embed_tokens.weight holds NaN or Inf values" in line and "the checkpoint of step 2 is kept" in line


def _recover(run: Path, capsys) -> None:
    """What the messages tell a user to do after a kill: export a finished run's newest checkpoint, resume an
    unfinished one, or start over when nothing was saved yet."""
    try:
        latest = find_latest(run)
    except CheckpointCorrupt:  # nothing saved yet
        latest = None
    if latest is None:
        assert main(["train", "--output", str(run), *RUN, "--save-every", "1", "--overwrite"]) == 0
    elif latest.name == "step-00000004" and not (run / "model").exists():
        assert main(["export", str(run), str(run / "model")]) == 0
    else:
        assert main(["train", "--resume", str(run)]) == 0
    capsys.readouterr()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_9_at_random_times_then_recovery_gives_the_uninterrupted_model(tmp_path, capsys, reference) -> None:
    """Three runs killed with SIGKILL: one inside the final export, two at random times. After each, the
    recovery the messages name ends with exactly the model of the run that was never interrupted, and no
    temporary directory is left."""
    import contextlib
    import os
    import random
    import signal
    import subprocess
    import sys
    import textwrap

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    env = dict(os.environ)  # with torch_kernels' backend
    for attempt in range(3):
        run = tmp_path / f"run{attempt}"
        marker = tmp_path / f"exporting{attempt}"
        argv = ["train", "--output", str(run), *RUN, "--save-every", "1"]
        if attempt == 0:  # inside the final export, after its first shard began
            script = textwrap.dedent(
                f"""
                import sys, time
                from pathlib import Path
                import slide_hf.export as export
                real = export.save_file
                def slow(*args, **kwargs):
                    real(*args, **kwargs)
                    Path({str(marker)!r}).touch()
                    time.sleep(120)
                export.save_file = slow
                from slide_hf.cli.main import main
                sys.exit(main({argv!r}))
                """
            )
            process = subprocess.Popen([sys.executable, "-c", script], env=env)
            deadline = time.monotonic() + 240
            while not marker.exists():
                assert process.poll() is None and time.monotonic() < deadline, "the export under test never began"
                time.sleep(0.1)
        else:
            process = subprocess.Popen([sys.executable, "-m", "slide_hf.cli.main", *argv], env=env)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=rng.uniform(2.0, 25.0))
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait()
        if attempt == 0:
            assert list(run.glob(".model.tmp-*")), "the kill did not land inside the export"
        _recover(run, capsys)
        assert _same_model(run / "model", reference), f"attempt {attempt} (random seed {seed})"
        assert not list(run.glob(".model.tmp-*")) and not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.timeout(180)
def test_sigterm_during_an_evaluation_cuts_it_short_and_checkpoints_the_step(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Note [A stop cuts an evaluation short]: a SIGTERM in an evaluation's first group ends it there (no
    record), the step just done is checkpointed, the run stops with 143 and a resume finishes the run."""
    from slide_core.engine import Engine
    from slide_hf import recipe

    monkeypatch.setattr(recipe._Evaluator, "GROUP", 2)  # groups of 2 micro-batches: several per evaluation
    evaluate = Engine.evaluate
    calls: list[int] = []

    def evaluating(engine: Engine, batches, *args, **kwargs):
        calls.append(len(batches))
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(engine, batches, *args, **kwargs)

    monkeypatch.setattr(Engine, "evaluate", evaluating)
    output = tmp_path / "run"
    argv = ["train", "--output", str(output), "--steps", "4", "--seq-len", "32", "--batch-size", "1"]
    argv += ["--eval-fraction", "0.25", "--eval-every", "2"]
    assert main(argv) == 143
    err = capsys.readouterr().err
    assert "stopped by SIGTERM after step 2; its checkpoint is saved" in err
    assert calls == [2]  # the evaluation went no further than the group the signal came in
    assert [path.name for path in list_checkpoints(output / "checkpoints")] == ["step-00000002"]
    assert "eval_loss" not in (output / "metrics.jsonl").read_text()

    monkeypatch.setattr(Engine, "evaluate", evaluate)
    assert main(["train", "--resume", str(output)]) == 0
    records = (output / "metrics.jsonl").read_text()
    assert records.count('"eval_loss"') == 1  # the last step's evaluation (steps 3 and 4)


@pytest.mark.timeout(120)
def test_sigterm_before_the_first_step_is_one_line_and_a_rerun_starts(tmp_path: Path, monkeypatch, capsys) -> None:
    """A SIGTERM while the run prepares its data (before the run's own handlers) ends `slide train` as
    Ctrl-C does: one line, 143, its temporary files gone, so the same command starts again."""
    from slide_hf import recipe

    prepare = recipe._setup_data_once

    def preparing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice as the data is tokenized
        return prepare(*args, **kwargs)

    monkeypatch.setattr(recipe, "_setup_data_once", preparing)
    output = tmp_path / "run"
    argv = ["train", "--output", str(output), "--steps", "2", "--seq-len", "32"]
    assert main(argv) == 143
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("slide train:")]
    assert line == "slide train: interrupted by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the command's handler is gone again
    monkeypatch.setattr(recipe, "_setup_data_once", prepare)
    assert main(argv) == 0 and (output / "model").is_dir()
