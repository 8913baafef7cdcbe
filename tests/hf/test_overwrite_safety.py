"""`slide train --overwrite` removes only the files slide recorded writing (slide_hf/run_files.py).

It once removed ``model/``, ``checkpoints/``, ``config/`` ... by name: the model a run was told to train
from (``--model RUN/model``), a data file kept in ``checkpoints/`` and the user's notes in ``model/`` were
deleted before the run failed or went on. These tests run the CLI in-process on the CPU with the tiny
preset and check, file by file, what is left.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from slide_core.checkpoint import list_checkpoints
from slide_hf.cli.main import main
from slide_hf.run_dir import LOCK_FILE
from slide_hf.run_files import RECORD_FILE, RunFiles, read_record

TINY = ("--device", "cpu", "--dtype", "float32", "--seq-len", "16", "--batch-size", "2")

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, torch_kernels_module) -> Path:
    """A finished 2-step run (checkpoint, model, logs, data cache); tests copy it."""
    run = tmp_path_factory.mktemp("overwrite") / "run"
    assert main(["train", "--output", str(run), *TINY, "--steps", "2"]) == 0
    return run


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
        if p.name not in (LOCK_FILE, "train.log", "options.json")
    }


def _error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def _data(path: Path, lines: int = 64) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"line {i} of the user's own data"}) + "\n" for i in range(lines)))
    return path


def test_the_record_lists_every_file_a_run_wrote(finished_run: Path) -> None:
    written = {
        p.relative_to(finished_run).as_posix()
        for p in finished_run.rglob("*")
        if p.is_file() and p.name not in (LOCK_FILE, RECORD_FILE)
    }
    assert read_record(finished_run) == written
    assert {"model/config.json", "checkpoints/step-00000002/state.json", "options.json"} <= written


def test_overwrite_refuses_to_remove_the_model_it_trains_from(tmp_path: Path, finished_run: Path, capsys) -> None:
    run = _copy(finished_run, tmp_path / "ow1")
    before = _hashes(run)
    argv = ["train", "--model", str(run / "model"), "--output", str(run), *TINY, "--steps", "1", "--overwrite"]
    assert main(argv) == 2
    line = _error(capsys)
    assert f"--model {run / 'model'} is in {run}" in line and "--overwrite" in line, line
    assert _hashes(run) == before  # the model and every checkpoint are still there


def test_overwrite_keeps_a_data_file_kept_in_checkpoints(tmp_path: Path, finished_run: Path, caplog) -> None:
    run = _copy(finished_run, tmp_path / "ow3")
    data = _data(run / "checkpoints" / "mydata.jsonl")
    content = data.read_bytes()
    caplog.set_level("INFO", logger="slide.train")
    argv = ["train", "--data", str(data), "--output", str(run), *TINY, "--steps", "1", "--overwrite"]
    assert main(argv) == 0
    assert data.read_bytes() == content
    # The earlier run's checkpoint is gone, the new one is there, and the log says what stayed.
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000001"]
    kept = [r.getMessage() for r in caplog.records if "--overwrite: kept" in r.getMessage()]
    assert len(kept) == 1 and "checkpoints/ (mydata.jsonl)" in kept[0], kept
    assert "mydata.jsonl" in str(json.loads((run / "options.json").read_text())["data"])  # trained on it


def test_overwrite_keeps_the_users_files_in_model_through_the_export(
    tmp_path: Path, finished_run: Path, caplog
) -> None:
    run = _copy(finished_run, tmp_path / "run")
    (run / "model" / "README.md").write_text("the user's model card")
    (run / "model" / "eval").mkdir()
    (run / "model" / "eval" / "scores.json").write_text("{}")
    old_weights = (run / "model" / "model.safetensors").read_bytes()
    caplog.set_level("INFO", logger="slide.train")
    assert main(["train", "--output", str(run), *TINY, "--steps", "1", "--seed", "1", "--overwrite"]) == 0
    assert (run / "model" / "README.md").read_text() == "the user's model card"
    assert (run / "model" / "eval" / "scores.json").read_text() == "{}"
    assert (run / "model" / "model.safetensors").read_bytes() != old_weights  # the new run's model
    assert not list(run.glob(".model.keep-*"))
    kept = [r.getMessage() for r in caplog.records if "--overwrite: kept" in r.getMessage()]
    assert len(kept) == 1 and "model/ (README.md, eval/scores.json)" in kept[0], kept
    # The user's files are still not slide's: the next --overwrite keeps them too.
    assert "model/README.md" not in read_record(run)
    assert main(["train", "--output", str(run), *TINY, "--steps", "1", "--overwrite"]) == 0
    assert (run / "model" / "README.md").read_text() == "the user's model card"


def test_overwrite_of_a_folder_of_the_users_removes_nothing(tmp_path: Path) -> None:
    userdir = tmp_path / "userdir"
    (userdir / "model").mkdir(parents=True)
    (userdir / "model" / "notes.txt").write_text("the user's notes")
    assert main(["train", "--output", str(userdir), *TINY, "--steps", "1", "--overwrite"]) == 0
    assert (userdir / "model" / "notes.txt").read_text() == "the user's notes"
    assert (userdir / "model" / "config.json").is_file()  # the run's model beside them
    assert "model/notes.txt" not in read_record(userdir)


def test_overwrite_refuses_a_run_that_kept_no_record(tmp_path: Path, finished_run: Path, capsys) -> None:
    """A run of a slide from before the record: nothing says which files are slide's, so none goes."""
    run = _copy(finished_run, tmp_path / "old")
    (run / RECORD_FILE).unlink()
    before = _hashes(run)
    assert main(["train", "--output", str(run), *TINY, "--steps", "1", "--overwrite"]) == 2
    assert "kept no record of the files it wrote" in _error(capsys)
    assert _hashes(run) == before


def test_a_resumed_run_without_a_record_takes_its_checkpoints_as_slides(tmp_path: Path, finished_run: Path) -> None:
    """Resuming such a run starts its record: its checkpoints are slide's, the user's files are not."""
    run = _copy(finished_run, tmp_path / "old")
    (run / RECORD_FILE).unlink()
    (run / "checkpoints" / "notes.txt").write_text("mine")
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 0
    recorded = read_record(run)
    assert recorded is not None and "checkpoints/step-00000002/state.json" in recorded
    assert "checkpoints/notes.txt" not in recorded
    assert main(["train", "--output", str(run), *TINY, "--steps", "1", "--overwrite"]) == 0
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000001"]
    assert (run / "checkpoints" / "notes.txt").read_text() == "mine"


def test_overwrite_refuses_a_toml_file_among_slides_files(tmp_path: Path, finished_run: Path, capsys) -> None:
    """A file the record lists (here one the user wrote into config/ while a run held the directory, so
    the run recorded it) is not removed when it is the --config file of the run that would remove it."""
    run = _copy(finished_run, tmp_path / "run")
    toml = run / "config" / "run.toml"
    toml.write_text(f'output = "{run}"\nsteps = 1\ndevice = "cpu"\nseq_len = 16\n')
    record = json.loads((run / RECORD_FILE).read_text())
    record["files"].append("config/run.toml")
    (run / RECORD_FILE).write_text(json.dumps(record))
    before = _hashes(run)
    assert main(["train", "--config", str(toml), "--overwrite"]) == 2
    line = _error(capsys)
    assert f"--config {toml} is in {run}" in line and "--overwrite" in line, line
    assert _hashes(run) == before


def test_export_into_the_runs_model_keeps_the_users_files(tmp_path: Path, finished_run: Path) -> None:
    """`slide export RUN RUN/model --overwrite` replaces the folder whole, as the run's own export does:
    the user's files in it come through, and the new model's files are slide's in the record."""
    run = _copy(finished_run, tmp_path / "run")
    (run / "model" / "README.md").write_text("the user's model card")
    assert main(["export", str(run), str(run / "model"), "--overwrite"]) == 0
    assert (run / "model" / "README.md").read_text() == "the user's model card"
    assert not list(run.glob(".model.keep-*"))
    recorded = read_record(run)
    assert recorded is not None and "model/config.json" in recorded and "model/README.md" not in recorded


def _edit(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` in place (same inode), with an mtime certainly newer."""
    before = path.stat().st_mtime_ns
    with path.open("a", encoding="utf-8") as handle:
        handle.write(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_a_users_file_edited_during_a_run_stays_the_users(tmp_path: Path, finished_run: Path, monkeypatch) -> None:
    """A file the user keeps in model/, edited in place while a resumed run holds the directory, is
    not claimed by the run's next record: the export carries it over and --overwrite keeps it."""
    run = _copy(finished_run, tmp_path / "run")
    card = run / "model" / "README.md"
    card.write_text("the user's model card")
    record = RunFiles.record

    def edited_first(self: RunFiles, *, force: bool = False) -> None:
        if not force and card.read_text() == "the user's model card":
            _edit(card, ", edited")
        record(self, force=force)

    monkeypatch.setattr(RunFiles, "record", edited_first)
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 0
    monkeypatch.undo()
    assert card.read_text() == "the user's model card, edited"
    assert "model/README.md" not in read_record(run)
    assert main(["train", "--output", str(run), *TINY, "--steps", "1", "--overwrite"]) == 0
    assert card.read_text() == "the user's model card, edited"


def test_only_slides_appended_files_are_claimed_by_their_mtime(tmp_path: Path) -> None:
    """An unrecorded train.log that a run appends to becomes slide's; a user's file edited in place does not."""
    (tmp_path / "model").mkdir()
    notes, log = tmp_path / "model" / "notes.txt", tmp_path / "train.log"
    notes.write_text("mine")
    log.write_text("an earlier line\n")
    files = RunFiles.claim(tmp_path, resuming=False)
    assert files.files == frozenset()
    _edit(notes, " and more")
    _edit(log, "the run's line\n")
    files.record()
    assert files.files == {"train.log"}
