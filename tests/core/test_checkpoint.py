"""slide_core.checkpoint: atomic saves, verified loads, and a full disk that loses nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from slide_core.checkpoint import (
    CheckpointCorrupt,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"master": torch.randn(10_001, generator=generator), "exp_avg": torch.randn(10_001, generator=generator)}


def test_round_trip_and_keep_last(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _tensors(step), {"step": step})
    prune_checkpoints(tmp_path, keep=2)
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
    from slide_core import checkpoint as module

    monkeypatch.setattr(module, "_BLOCK_BYTES", 4096)  # several blocks at test sizes
    data = torch.randn(2500)  # 10,000 bytes: blocks of 1024, 1024 and 452 elements
    source = _Blocks(data)
    as_source = save_checkpoint(tmp_path / "a", 1, {"exp_avg": source}, {})
    as_tensor = save_checkpoint(tmp_path / "b", 1, {"exp_avg": data}, {})
    assert source.reads == [(0, 1024), (1024, 1024), (2048, 452)]
    assert (as_source / "exp_avg.bin").read_bytes() == (as_tensor / "exp_avg.bin").read_bytes()
    state_a = json.loads((as_source / "state.json").read_text())["files"]
    state_b = json.loads((as_tensor / "state.json").read_text())["files"]
    assert state_a == state_b
    out = torch.empty(2500)
    load_checkpoint(as_source, {"exp_avg": out})
    assert torch.equal(out, data)
