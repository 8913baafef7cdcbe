"""slide_hf.run_dir: an output directory belongs to one run (lock, reuse policy, stale leftovers, rollback)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from slide_core.checkpoint import find_latest, list_checkpoints
from slide_hf.cli.main import main
from slide_hf.errors import UserError
from slide_hf.run_dir import LOCK_FILE, RECORD_FILE, RunDir, clean_if_idle, default_output, locked, run_of

TINY = ("--device", "cpu", "--dtype", "float32", "--seq-len", "16", "--batch-size", "2", "--steps", "2")


pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, torch_kernels_module) -> Path:
    """A finished 2-step run (checkpoint, model, logs); tests copy it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", "--output", str(run), *TINY]) == 0
    return run


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


def _error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_reusing_an_output_needs_resume_or_overwrite(tmp_path: Path, finished_run: Path, capsys) -> None:
    run = _copy(finished_run, tmp_path / "run")
    (run / "notes.txt").write_text("the user's own notes")
    before = _hashes(run)
    assert main(["train", "--output", str(run), *TINY, "--seed", "1"]) == 2
    line = _error(capsys)
    assert f"output directory {run} is not empty" in line
    assert f"--resume {run}" in line and "--overwrite" in line
    assert _hashes(run) == before  # the earlier model and checkpoint are untouched

    assert main(["train", "--output", str(run), *TINY, "--seed", "1", "--overwrite"]) == 0
    assert (run / "notes.txt").read_text() == "the user's own notes"  # never a file slide did not write
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000002"]
    assert _hashes(run)["model/model.safetensors"] != before["model/model.safetensors"]  # the new run's model


def test_the_current_directory_is_never_an_output(tmp_path: Path, monkeypatch, capsys) -> None:
    work = tmp_path / "work"
    (work / "model").mkdir(parents=True)
    (work / "model" / "mine.bin").write_bytes(b"the user's model")
    monkeypatch.chdir(work)
    for output in ("", ".", str(work), str(tmp_path)):
        assert main(["train", "--output", output, *TINY]) == 2, output
        assert "--output" in _error(capsys)
    assert (work / "model" / "mine.bin").read_bytes() == b"the user's model"
    assert sorted(p.name for p in work.iterdir()) == ["model"]


def test_a_live_run_holds_its_output(tmp_path: Path, capsys) -> None:
    output = tmp_path / "run"
    with RunDir(output):
        assert main(["train", "--output", str(output), *TINY]) == 2
        line = _error(capsys)
        assert f"output directory {output} is in use by another slide run (pid {os.getpid()})" in line
        assert {p.name for p in output.iterdir()} <= {LOCK_FILE, RECORD_FILE}  # the holder's, none of its own
    with RunDir(output) as again:  # released with the run: a later run (or a killed one's successor) gets it
        assert again.path == output


def test_default_names_of_runs_started_together_differ() -> None:
    names = {default_output() for _ in range(50)}
    assert len(names) == 50
    assert all(str(name).startswith("runs/") for name in names)


def test_a_run_that_fails_before_training_leaves_no_directory(tmp_path: Path, capsys) -> None:
    empty_model = tmp_path / "model"
    empty_model.mkdir()
    (empty_model / "config.json").write_text('{"model_type": "llama"')  # cut off
    output = tmp_path / "out" / "run"
    assert main(["train", "--output", str(output), "--model", str(empty_model), *TINY]) == 2
    _error(capsys)
    assert not output.exists()


def test_resuming_an_older_checkpoint_sets_the_later_line_aside(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert (
        main(["train", "--output", str(run), *TINY, "--steps", "4", "--save-every", "1", "--keep-checkpoints", "9"])
        == 0
    )
    abandoned_model = (run / "model" / "model.safetensors").read_bytes()
    # Roll back to step 2 and end this line at step 3.
    assert main(["train", "--resume", str(run / "checkpoints" / "step-00000002"), "--steps", "3"]) == 0
    (aside,) = (run / "checkpoints").glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == ["model", "step-00000003", "step-00000004"]
    assert (aside / "model" / "model.safetensors").read_bytes() == abandoned_model
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == [
        "step-00000001",
        "step-00000002",
        "step-00000003",
    ]
    # The next --resume continues the new line, not the abandoned step 4.
    assert find_latest(run) == run / "checkpoints" / "step-00000003"
    assert main(["train", "--resume", str(run), "--steps", "4"]) == 0
    assert [p.name for p in list_checkpoints(run / "checkpoints")][-1] == "step-00000004"
    assert (aside / "step-00000004" / "state.json").is_file()  # still there, never pruned


def test_resume_with_overwrite_keeps_the_checkpoints_it_resumes(tmp_path: Path, finished_run: Path) -> None:
    run = _copy(finished_run, tmp_path / "run")
    assert main(["train", "--resume", str(run), "--steps", "3", "--overwrite"]) == 0
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000002", "step-00000003"]


def test_stale_temp_dirs_go_only_when_no_run_holds_the_directory(tmp_path: Path, finished_run: Path) -> None:
    run = _copy(finished_run, tmp_path / "run")
    stale = [run / ".model.tmp-0123456789ab", run / "checkpoints" / ".tmp-step-00000003-4242"]
    with locked(run):  # a live run, writing its temp dirs
        for path in stale:
            path.mkdir()
            (path / "part.bin").write_bytes(b"x" * 100)
        clean_if_idle(run)
        assert all(p.exists() for p in stale)
    clean_if_idle(run)  # the run was killed: its lock is free, its temp dirs are leftovers
    assert not any(p.exists() for p in stale)
    # `slide export` cleans up the same way before it reads the run.
    for path in stale:
        path.mkdir()
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    assert not any(p.exists() for p in stale)


def test_nvme_scratch_of_killed_runs_is_removed_and_live_ones_kept(tmp_path: Path) -> None:
    """A killed run's folder (its lock file free) is removed; a live run's (locked) and one another process
    has just created and not locked yet (no lock file) are left alone."""
    nvme = tmp_path / "nvme"
    dead, live, fresh = (nvme / f"slide-nvme-run-{name}" for name in ("dead", "live", "fresh"))
    for folder in (dead, live, fresh):
        (folder / "slide-nvme-abcdefgh").mkdir(parents=True)
        (folder / "slide-nvme-abcdefgh" / "state.bin").write_bytes(b"x" * 100)
    (dead / ".slide.lock").write_text("12345\n")  # what a killed run leaves: its lock file, unlocked
    with locked(live, "scratch"):
        args = [*TINY, "--offload-optimizer", "nvme", "--nvme-dir", str(nvme), "--offload-activations", "nvme"]
        assert main(["train", "--output", str(tmp_path / "run"), *args]) == 0
        assert not dead.exists() and live.exists() and fresh.exists()
        assert sorted(p.name for p in nvme.iterdir()) == [fresh.name, live.name]  # the run removed its own too


def test_run_of_names_the_run_of_any_checkpoint(tmp_path: Path, finished_run: Path) -> None:
    checkpoint = find_latest(finished_run)
    assert run_of(checkpoint) == finished_run and run_of(finished_run) == finished_run
    aside = _copy(checkpoint, tmp_path / "run" / "checkpoints" / "abandoned-x" / checkpoint.name)
    assert run_of(aside) == tmp_path / "run"


def test_an_output_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(UserError, match="is a file, not a directory"), RunDir(target):
        pass
    assert target.read_text() == "x"


def test_the_resumed_model_equals_a_straight_run(tmp_path: Path) -> None:
    """Rollback and resume change which checkpoints are current, never the math: 3 steps via a step-2
    resume equal 3 steps straight."""
    from safetensors.torch import load_file

    straight, rolled = tmp_path / "straight", tmp_path / "rolled"
    assert main(["train", "--output", str(straight), *TINY, "--steps", "3"]) == 0
    assert main(["train", "--output", str(rolled), *TINY, "--steps", "3", "--save-every", "1"]) == 0
    assert main(["train", "--resume", str(rolled / "checkpoints" / "step-00000002")]) == 0
    a, b = load_file(straight / "model" / "model.safetensors"), load_file(rolled / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
