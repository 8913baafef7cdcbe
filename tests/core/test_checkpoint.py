"""slide_core.checkpoint: atomic saves, verified loads (state.json checksummed, every field checked), and a
full disk that loses nothing."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from legacy_checkpoint_layouts import write_single

from slide_core.checkpoint import (
    CheckpointCorrupt,
    CheckpointWriteError,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    newest_intact,
    prune,
    read_state,
    save_checkpoint,
    verify_checkpoint,
)
from slide_core.checkpoint import manifest as manifest_module
from slide_core.checkpoint.manifest import checksum

SHARD = "shard-00000-of-00001.bin"


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"master": torch.randn(10_001, generator=generator), "exp_avg": torch.randn(10_001, generator=generator)}


def test_round_trip_and_keep_last(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _tensors(step), {"step": step})
    prune(tmp_path, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    out = {name: torch.empty_like(t) for name, t in _tensors(0).items()}
    state = load_checkpoint(find_latest(tmp_path), out)
    assert state["step"] == 3 and state["extra"] == {"step": 3}
    for name, tensor in _tensors(3).items():
        assert torch.equal(out[name], tensor)


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path, 1, _tensors(1), {})
    with pytest.raises(CheckpointCorrupt, match="a different model"):
        load_checkpoint(saved, {"master": torch.empty(7), "exp_avg": torch.empty(7)})


def test_missing_checkpoint_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointCorrupt, match="no checkpoint found"):
        find_latest(tmp_path)


@pytest.mark.slow  # a fresh Python process: seconds of imports
@pytest.mark.timeout(60)
def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """The file-size limit stands in for a full disk: the write fails with EFBIG part-way through."""
    save_checkpoint(tmp_path, 1, _tensors(1), {"step": 1})
    script = textwrap.dedent(
        f"""
        import resource, signal, torch
        from pathlib import Path
        from slide_core.checkpoint import save_checkpoint, CheckpointWriteError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
        try:
            save_checkpoint(Path({str(tmp_path)!r}), 2, {{"master": torch.randn(100_000)}}, {{}})
        except CheckpointWriteError as error:
            print("ERROR", error)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "ERROR" in result.stdout, result.stderr
    assert "cannot write checkpoint" in result.stdout and "GiB free" in result.stdout
    assert f"the previous checkpoint {tmp_path / 'step-00000001'} is kept" in result.stdout
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001"]
    assert not list(tmp_path.glob(".tmp-*")), "the partial save was not cleaned up"
    out = {name: torch.empty_like(t) for name, t in _tensors(1).items()}
    load_checkpoint(find_latest(tmp_path), out)
    assert torch.equal(out["master"], _tensors(1)["master"])


class _Blocks:
    """An ArraySource over a host tensor that records the block reads."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.numel, self.dtype = tensor, tensor.numel(), tensor.dtype
        self.reads: list[tuple[int, int]] = []

    def read_into(self, start: int, out: torch.Tensor) -> None:
        self.reads.append((start, out.numel()))
        out.copy_(self.tensor[start : start + out.numel()])


def test_array_source_is_written_block_by_block_like_a_tensor(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(manifest_module, "BLOCK_BYTES", 4096)  # several blocks at test sizes
    data = torch.randn(2500)  # 10,000 bytes: blocks of 1024, 1024 and 452 elements
    source = _Blocks(data)
    as_source = save_checkpoint(tmp_path / "a", 1, {"exp_avg": source}, {})
    as_tensor = save_checkpoint(tmp_path / "b", 1, {"exp_avg": data}, {})
    assert source.reads == [(0, 1024), (1024, 1024), (2048, 452)]
    assert (as_source / SHARD).read_bytes() == (as_tensor / SHARD).read_bytes()
    state_a = json.loads((as_source / "state.json").read_text())["shards"]
    state_b = json.loads((as_tensor / "state.json").read_text())["shards"]
    assert state_a == state_b and len(state_a[0]["parts"]["exp_avg"]["crc32"]) == 3
    out = torch.empty(2500)
    load_checkpoint(as_source, {"exp_avg": out})
    assert torch.equal(out, data)


def _state(path: Path) -> dict:
    return json.loads((path / "state.json").read_text())


def _write_state(path: Path, state: dict) -> None:
    (path / "state.json").write_text(json.dumps(state))


def test_a_valid_json_edit_of_state_json_fails_its_checksum(tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path, 4, _tensors(4), {"data": {"index": 8}})
    state = _state(saved)
    assert state["format"] == 3 and state["checksum"].startswith("sha256:")
    for edit in ({"step": 40}, {"step": -1}, {"extra": {"data": {"index": 9}}}):
        _write_state(saved, {**state, **edit})
        with pytest.raises(CheckpointCorrupt, match=r"state\.json fails its checksum"):
            read_state(saved)
    _write_state(saved, state)  # the untouched state still verifies, whitespace aside
    assert read_state(saved)["extra"] == {"data": {"index": 8}}


def _resealed(state: dict) -> dict:
    """``state`` with its checksum recomputed: what a deliberate edit would write."""
    return {**state, "checksum": checksum(state)}


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda s: s.update(step=-3), "field step must be an integer >= 0, got -3"),
        (lambda s: s.update(step="4"), "field step must be an integer >= 0"),
        (lambda s: s.update(step=True), "field step must be an integer >= 0"),
        (lambda s: s.pop("step"), "field step must be an integer >= 0, got None"),
        (lambda s: s.update(world_size=0), "field world_size must be an integer >= 1, got 0"),
        (lambda s: s.update(arrays=[]), "field arrays must be an object"),
        (lambda s: s["arrays"]["master"].update(numel=-1), "arrays.master.numel must be an integer >= 0"),
        (lambda s: s["arrays"]["master"].update(dtype="float99"), "arrays.master.dtype must name a torch dtype"),
        (lambda s: s.update(shards=[]), "field shards must list 1 shard(s)"),
        (lambda s: s["shards"][0].update(file="../x.bin"), "shards[0].file must name a file of the checkpoint"),
        (lambda s: s["shards"][0].update(bytes=7), "shards[0].bytes must be 80008 (the sum of its parts), got 7"),
        (lambda s: s["shards"][0]["parts"]["exp_avg"].update(offset=4), "parts.exp_avg.offset must be 40004, got 4"),
        (lambda s: s["shards"][0]["parts"]["master"].update(crc32=[]), "parts.master.crc32 must list 1 block"),
        (
            lambda s: s["shards"][0]["parts"]["master"].update(intervals=[[0, 20_000]]),
            "parts.master.intervals must list ordered ranges",
        ),
        (lambda s: s.update(extra=[1]), "field extra must be an object"),
        (lambda s: s.update(format=7), "field format is 7"),
    ],
)
def test_malformed_fields_of_a_resealed_state_are_named(tmp_path: Path, edit, named: str) -> None:
    """An edit that recomputes the checksum still gets every field checked, each named in the message."""
    saved = save_checkpoint(tmp_path, 1, _tensors(1), {})
    state = _state(saved)
    edit(state)
    _write_state(saved, _resealed(state))
    with pytest.raises(CheckpointCorrupt, match=re.escape(named)) as raised:
        load_checkpoint(saved, {name: torch.empty_like(t) for name, t in _tensors(1).items()})
    assert raised.value.checkpoint == saved and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda s: s.update(step=-3), "field step must be an integer >= 0, got -3"),
        (lambda s: s.update(files=[]), "field files must be an object"),
        (lambda s: s["files"]["master.bin"].update(numel=-1), "files.master.bin.numel must be an integer >= 0"),
        (lambda s: s["files"]["master.bin"].update(dtype="float99"), "files.master.bin.dtype must name a torch dtype"),
        (lambda s: s["files"]["master.bin"].update(bytes=7), "files.master.bin.bytes is 7"),
        (lambda s: s["files"]["master.bin"].update(crc32=[]), "files.master.bin.crc32 must list 1 block"),
        (lambda s: s["files"]["master.bin"].update(crc32=["x"]), "files.master.bin.crc32 must list 1 block"),
        (lambda s: s.update(extra=[1]), "field extra must be an object"),
    ],
)
def test_malformed_fields_of_an_unchecksummed_legacy_state_are_named(tmp_path: Path, edit, named: str) -> None:
    """A format-1 state (one file per array, no checksum) still gets every field checked."""
    saved = write_single(tmp_path / "step-00000001", 1, _tensors(1), {})
    state = _state(saved)
    state.pop("checksum")
    state["format"] = 1
    edit(state)
    _write_state(saved, state)
    with pytest.raises(CheckpointCorrupt, match=re.escape(named)) as raised:
        load_checkpoint(saved, {name: torch.empty_like(t) for name, t in _tensors(1).items()})
    assert raised.value.checkpoint == saved and "\n" not in str(raised.value)


def test_undecodable_or_invalid_state_json_is_one_line(tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path, 1, _tensors(1), {})
    raw = bytearray((saved / "state.json").read_bytes())
    raw[5] = 0xFF  # a flipped byte that is not UTF-8
    (saved / "state.json").write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorrupt, match=r"state\.json is not UTF-8 text: byte 5 is 0xff"):
        read_state(saved)
    (saved / "state.json").write_text('{"format": 2, "step": ')
    with pytest.raises(CheckpointCorrupt, match=r"state\.json is not valid JSON"):
        read_state(saved)
    (saved / "state.json").write_text("[]")
    with pytest.raises(CheckpointCorrupt, match="holds no JSON object"):
        read_state(saved)
    (saved / "state.json").unlink()
    with pytest.raises(CheckpointCorrupt, match=r"state\.json is missing"):
        read_state(saved)


def test_format_1_checkpoints_still_load_and_say_so(tmp_path: Path, caplog) -> None:
    saved = write_single(tmp_path / "step-00000002", 2, _tensors(2), {"step": 2})
    state = _state(saved)
    state.pop("checksum")
    state["format"] = 1
    _write_state(saved, state)
    out = {name: torch.empty_like(t) for name, t in _tensors(2).items()}
    with caplog.at_level(logging.DEBUG, logger="slide.checkpoint"):
        assert load_checkpoint(saved, out)["step"] == 2
    assert torch.equal(out["master"], _tensors(2)["master"])
    assert "predates state.json checksums" in caplog.text


def test_a_missing_file_is_named_missing(tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path, 1, _tensors(1), {})
    (saved / SHARD).unlink()
    with pytest.raises(CheckpointCorrupt, match=rf"\({SHARD} is missing\)") as raised:
        load_checkpoint(saved, {name: torch.empty_like(t) for name, t in _tensors(1).items()})
    assert "-1 bytes" not in str(raised.value)


def test_write_error_without_an_earlier_checkpoint_says_none_is_kept(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    (root / "step-00000001").write_text("a file where the save needs a directory")  # rename fails: ENOTDIR
    with pytest.raises(CheckpointWriteError) as raised:
        save_checkpoint(root, 1, _tensors(1), {})
    message = str(raised.value.strerror)
    assert "no earlier checkpoint exists" in message and "previous checkpoint" not in message
    assert "GiB free" not in message  # the disk is not full; free space would only mislead
    assert not list(root.glob(".tmp-*"))


def test_newest_intact_skips_every_corrupt_checkpoint(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _tensors(step), {})
    first, second, third = list_checkpoints(tmp_path)
    verify_checkpoint(third)
    data = bytearray((third / SHARD).read_bytes())
    data[100] ^= 0x01
    (third / SHARD).write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=rf"{SHARD} fails its checksum in block 0 of master"):
        verify_checkpoint(third)
    assert newest_intact(third) == second
    (second / SHARD).write_bytes(b"short")
    assert newest_intact(third) == first
    (first / "state.json").write_text("{}")
    assert newest_intact(third) is None


def test_abandoned_lines_are_not_checkpoints_of_the_run(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, step, _tensors(step), {})
    aside = root / "abandoned-20260101-000000-abcdef"
    aside.mkdir()
    save_checkpoint(aside, 3, _tensors(3), {})
    assert [p.name for p in list_checkpoints(root)] == ["step-00000001", "step-00000002"]
    assert find_latest(tmp_path).name == "step-00000002"
