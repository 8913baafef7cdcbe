"""slide_core/checkpoint/retention.py (Note [Retention]) and the full-disk message of a save."""

from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

import pytest
import torch

from slide_core.checkpoint import CheckpointWriteError, checkpoint_nbytes, prune, retained, save_checkpoint, writer


def _save(root: Path, *steps: int) -> None:
    for step in steps:
        save_checkpoint(root, step, {"master": torch.full((16,), float(step))}, {})


def _tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_dir())


def test_keep_counts_the_newest_and_the_older_best_is_kept_in_addition(tmp_path: Path) -> None:
    _save(tmp_path, 1, 2)
    assert prune(tmp_path, 3) == [] and _tree(tmp_path) == ["step-00000001", "step-00000002"]  # fewer than keep
    _save(tmp_path, 3, 4, 5)
    best = tmp_path / "step-00000002"
    assert [p.name for p in retained(tmp_path, 2, protect=[best])] == [
        "step-00000002",
        "step-00000004",
        "step-00000005",
    ]
    removed = prune(tmp_path, 1, protect=[best])
    assert [p.name for p in removed] == ["step-00000001", "step-00000003", "step-00000004"]
    assert _tree(tmp_path) == ["step-00000002", "step-00000005"]
    # The best is the newest: it is the one kept, not one more (--keep-checkpoints 1 --save-best keeps one).
    prune(tmp_path, 1, protect=[tmp_path / "step-00000005"])
    assert _tree(tmp_path) == ["step-00000005"]


def test_abandoned_lines_are_older_than_the_current_line_and_go_first(tmp_path: Path) -> None:
    _save(tmp_path, 1, 2)  # the current line: resumed from step 2
    line = tmp_path / "abandoned-20260101-000000-abcdef"
    _save(line, 3, 4)  # the later checkpoints, set aside
    (line / "model").mkdir()  # the export of the abandoned line goes with it
    (line / "model" / "config.json").write_text("{}")
    prune(tmp_path, 3)
    # The newest three: the current line's steps 1 and 2 count as newer than the abandoned steps.
    assert _tree(tmp_path) == [
        "abandoned-20260101-000000-abcdef",
        "abandoned-20260101-000000-abcdef/model",
        "abandoned-20260101-000000-abcdef/step-00000004",
        "step-00000001",
        "step-00000002",
    ]
    _save(tmp_path, 3)
    prune(tmp_path, 3)  # the current line holds three: no abandoned checkpoint is left, its model stays
    assert _tree(tmp_path) == [
        "abandoned-20260101-000000-abcdef",
        "abandoned-20260101-000000-abcdef/model",
        "step-00000001",
        "step-00000002",
        "step-00000003",
    ]


def test_an_abandoned_line_loses_only_its_checkpoints_and_never_the_best(tmp_path: Path) -> None:
    """An abandoned folder also holds the model of its line (where the user may keep files of their own)
    and whatever else was set aside with it: pruning deletes its step-* checkpoints, never the rest nor
    the protected best, and removes the folder only once it is empty."""
    _save(tmp_path, 1, 2)
    line = tmp_path / "abandoned-20260101-000000-abcdef"
    _save(line, 3, 4, 5)
    (line / "model").mkdir()
    (line / "model" / "notes.txt").write_text("mine")
    (line / "weights" / "step-00000004").mkdir(parents=True)
    (line / "weights" / "step-00000004" / "config.json").write_text("{}")
    best = line / "step-00000004"
    removed = prune(tmp_path, 2, protect=[best])
    assert sorted(p.name for p in removed) == ["step-00000003", "step-00000005"]
    assert (line / "model" / "notes.txt").read_text() == "mine"
    assert (line / "weights" / "step-00000004" / "config.json").is_file()
    assert (best / "state.json").is_file()
    assert _tree(tmp_path) == [
        "abandoned-20260101-000000-abcdef",
        "abandoned-20260101-000000-abcdef/model",
        "abandoned-20260101-000000-abcdef/step-00000004",
        "abandoned-20260101-000000-abcdef/weights",
        "abandoned-20260101-000000-abcdef/weights/step-00000004",
        "step-00000001",
        "step-00000002",
    ]
    # A line left with nothing but its checkpoints goes once they do.
    other = tmp_path / "abandoned-20260102-000000-bbbbbb"
    _save(other, 6)
    prune(tmp_path, 2, protect=[best])
    assert not other.exists() and line.is_dir()
    # Once its last checkpoint goes, the line keeps the model and the weights set aside with it.
    prune(tmp_path, 2)
    assert not best.exists() and (line / "model" / "notes.txt").read_text() == "mine"
    assert (line / "weights" / "step-00000004" / "config.json").is_file()


def test_two_abandoned_lines_go_oldest_first(tmp_path: Path) -> None:
    _save(tmp_path / "abandoned-20260101-000000-aaaaaa", 5)
    _save(tmp_path / "abandoned-20260102-000000-bbbbbb", 3)
    _save(tmp_path, 2)
    prune(tmp_path, 2)
    assert _tree(tmp_path) == [
        "abandoned-20260102-000000-bbbbbb",
        "abandoned-20260102-000000-bbbbbb/step-00000003",
        "step-00000002",
    ]


def test_making_room_leaves_a_save_in_flight_alone(tmp_path: Path) -> None:
    _save(tmp_path, 1, 2)
    (tmp_path / ".tmp-step-00000003").mkdir()  # another rank's shard being written
    prune(tmp_path, 1, leftovers=False)
    assert _tree(tmp_path) == [".tmp-step-00000003", "step-00000002"]
    prune(tmp_path, 1)
    assert _tree(tmp_path) == ["step-00000002"]


def test_a_full_disk_names_what_the_checkpoint_needs_and_what_is_free(tmp_path: Path, monkeypatch) -> None:
    arrays = {"master": torch.zeros(3 * 2**18), "exp_avg": torch.zeros(2**18, dtype=torch.bfloat16)}  # 3.5 MiB
    extra = {"data": {"epoch": 0, "index": 3}}
    whole = save_checkpoint(tmp_path / "ok", 1, arrays, extra)
    real = sum(p.stat().st_size for p in whole.iterdir())
    assert real <= checkpoint_nbytes(arrays, extra) <= real + 4096

    def full(handle, data) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "_write", full)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=5 * 2**30 + 2**29))
    root = tmp_path / "full"
    with pytest.raises(CheckpointWriteError) as raised:
        save_checkpoint(root, 2, arrays, extra)
    message = str(raised.value.strerror)
    found = re.search(r"needs ([\d.]+) MiB, 5\.50 GiB free at (\S+)\)", message)
    assert found, message
    assert float(found.group(1)) == pytest.approx(real / 2**20, abs=0.01) and found.group(2) == str(root)
    assert "0.00" not in message and "no earlier checkpoint exists" in message
