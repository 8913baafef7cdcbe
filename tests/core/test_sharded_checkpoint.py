"""slide_core/sharded_checkpoint.py without processes: checkpoints of N ranks written by hand the way N
ranks write them (each rank's shard of every unit, in slab order, under a manifest), read back by every
rank of M for every N, M in 1..4: each rank gets exactly its shard of every unit. Damaged or missing
parts are named in one line, and only the blocks a rank needs are read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import slide_core.checkpoint as checkpoint_module
from slide_core.checkpoint import CheckpointCorrupt, save_checkpoint
from slide_core.distributed import shard_span
from slide_core.sharded_checkpoint import load_resharded, sharded_layout

NUMELS = [13, 64, 7, 1, 30]  # odd sizes: uneven shards, a unit smaller than some world sizes


class _Collect:
    """An ArraySink over a host tensor that also records the order of its writes."""

    def __init__(self, numel: int) -> None:
        self.numel, self.dtype = numel, torch.float32
        self.values = torch.full((numel,), float("nan"))
        self.starts: list[int] = []

    def write_from(self, start: int, block: torch.Tensor) -> None:
        self.starts.append(start)
        self.values[start : start + block.numel()].copy_(block)


def _arrays(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    total = sum(NUMELS)
    return {name: torch.randn(total, generator=generator) for name in ("master", "exp_avg")}


def _shards(whole: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    parts, start = [], 0
    for numel in NUMELS:
        lo, hi = shard_span(numel, rank, world_size)
        parts.append(whole[start + lo : start + hi])
        start += numel
    return torch.cat(parts)


def _write(root: Path, world_size: int, arrays: dict[str, torch.Tensor], step: int = 2) -> Path:
    """A step directory as ``world_size`` ranks write it (one process: a plain checkpoint)."""
    if world_size == 1:
        return save_checkpoint(root, step, arrays, {"engine": {"step": step}})
    step_dir = save_checkpoint(
        root, step, {}, {"world_size": world_size, "ranks": [f"rank-{r}" for r in range(world_size)]}
    )
    for rank in range(world_size):
        shards = {name: _shards(whole, rank, world_size) for name, whole in arrays.items()}
        saved = save_checkpoint(step_dir / f".r{rank}", step, shards, {})
        saved.rename(step_dir / f"rank-{rank}")
    return step_dir


@pytest.mark.parametrize("old", [1, 2, 3, 4])
def test_every_rank_of_every_world_size_reads_its_shards(tmp_path: Path, old: int) -> None:
    arrays = _arrays(old)
    step_dir = _write(tmp_path, old, arrays)
    assert sharded_layout(step_dir).world_size == old
    for new in (1, 2, 3, 4):
        for rank in range(new):
            sinks = {name: _Collect(_shards(whole, rank, new).numel()) for name, whole in arrays.items()}
            state = load_resharded(step_dir, sinks, NUMELS, rank, new)
            assert state["step"] == 2
            for name, whole in arrays.items():
                assert torch.equal(sinks[name].values, _shards(whole, rank, new)), (old, new, rank, name)
                assert sinks[name].starts == sorted(sinks[name].starts)  # in the sink's own order


def test_only_the_blocks_a_rank_needs_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With 64-byte blocks, rank 0 of 4 reading a 1-rank checkpoint verifies only the blocks that hold its
    shards: a damaged block elsewhere is never read by it, and fails the rank that needs it."""
    monkeypatch.setattr(checkpoint_module, "_BLOCK_BYTES", 64)
    monkeypatch.setattr("slide_core.sharded_checkpoint._BLOCK_BYTES", 64)
    arrays = {"master": torch.arange(float(sum(NUMELS)))}
    step_dir = _write(tmp_path, 1, arrays)
    # The last unit's last shard (rank 3 of 4) lies in the file's last block: damage that block.
    data = bytearray((step_dir / "master.bin").read_bytes())
    data[-1] ^= 0xFF
    (step_dir / "master.bin").write_bytes(bytes(data))
    sink = _Collect(_shards(arrays["master"], 0, 4).numel())
    load_resharded(step_dir, {"master": sink}, NUMELS, 0, 4)
    assert torch.equal(sink.values, _shards(arrays["master"], 0, 4))
    sink = _Collect(_shards(arrays["master"], 3, 4).numel())
    with pytest.raises(CheckpointCorrupt, match=r"master.bin fails its checksum in block 7"):
        load_resharded(step_dir, {"master": sink}, NUMELS, 3, 4)


def test_a_missing_rank_is_named(tmp_path: Path) -> None:
    step_dir = _write(tmp_path, 3, _arrays(0))
    for path in (step_dir / "rank-1").iterdir():
        path.unlink()
    (step_dir / "rank-1").rmdir()
    sink = _Collect(sum(NUMELS))
    with pytest.raises(CheckpointCorrupt) as info:
        load_resharded(step_dir, {"master": sink}, NUMELS, 0, 1)
    assert str(info.value) == f"checkpoint {step_dir / 'rank-1'} is corrupt (state.json is missing)"
    assert info.value.checkpoint == step_dir


def test_a_shard_of_another_model_is_named(tmp_path: Path) -> None:
    step_dir = _write(tmp_path, 2, _arrays(0))
    sink = _Collect(sum(NUMELS) + 1)
    with pytest.raises(
        CheckpointCorrupt, match=r"rank-0/master.bin holds 59 x float32; rank 0 of 2 of this model would hold 60"
    ):
        load_resharded(step_dir, {"master": sink}, [*NUMELS, 1], 0, 1)


def test_a_bad_manifest_is_named(tmp_path: Path) -> None:
    step_dir = _write(tmp_path, 2, _arrays(0))
    state = json.loads((step_dir / "state.json").read_text())
    state["extra"]["ranks"] = ["rank-0"]
    body = {key: value for key, value in state.items() if key != "checksum"}
    state["checksum"] = checkpoint_module._checksum(body)
    (step_dir / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointCorrupt, match=r"extra.ranks must name 2 rank folders"):
        sharded_layout(step_dir)
