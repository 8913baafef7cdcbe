"""slide_core/checkpoint across world sizes, without processes: checkpoints saved by N ranks (each rank's
shard of every unit, in slab order, under one manifest; the ranks' barriers stand in for by calling rank
0 last) read back by every rank of M for every N, M in 1..4, bit for bit. The older layouts (one file per
array; a manifest over rank folders) read back the same way. Damaged or missing parts are named in one
line, and only the blocks a rank needs are read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from legacy_checkpoint_layouts import shards_of, write_data_parallel, write_single

from slide_core.checkpoint import CheckpointCorrupt, load_checkpoint, read_state, save_checkpoint, verify_checkpoint
from slide_core.checkpoint import manifest as manifest_module
from slide_core.distributed import shard_span

NUMELS = [13, 64, 7, 1, 30]  # odd sizes: uneven shards, a unit smaller than some world sizes
WHOLE = sum(NUMELS)
EXTRA = {"engine": {"step": 2}}


def _intervals(rank: int, world_size: int) -> list[tuple[int, int]]:
    intervals, start = [], 0
    for numel in NUMELS:
        lo, hi = shard_span(numel, rank, world_size)
        intervals.append((start + lo, start + hi))
        start += numel
    return intervals


class _Shard:
    """Rank ``rank`` of ``world_size``'s shard of a whole host array: an ArraySource with its ranges."""

    def __init__(self, whole: torch.Tensor, rank: int, world_size: int) -> None:
        self.data = shards_of(whole, NUMELS, rank, world_size)
        self.numel, self.dtype = self.data.numel(), whole.dtype
        self.whole_numel, self.intervals = whole.numel(), _intervals(rank, world_size)

    def read_into(self, start: int, out: torch.Tensor) -> None:
        out.copy_(self.data[start : start + out.numel()])


class _Collect:
    """An ArraySink of rank ``rank`` of ``world_size``'s shards that records the order of its writes."""

    def __init__(self, rank: int, world_size: int, dtype: torch.dtype = torch.float32) -> None:
        self.whole_numel, self.intervals = WHOLE, _intervals(rank, world_size)
        self.numel, self.dtype = sum(hi - lo for lo, hi in self.intervals), dtype
        self.values = torch.full((self.numel,), float("nan"), dtype=dtype)
        self.starts: list[int] = []

    def write_from(self, start: int, block: torch.Tensor) -> None:
        self.starts.append(start)
        self.values[start : start + block.numel()].copy_(block)


class _Group:
    """A rank of ``world_size`` whose barriers return at once (the test orders the ranks instead)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def barrier(self, what: str, *, slow: bool = False) -> None:
        pass


def _arrays(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "master": torch.randn(WHOLE, generator=generator),
        "exp_avg": torch.randn(WHOLE, generator=generator).bfloat16(),
    }


def _save(root: Path, world_size: int, arrays: dict[str, torch.Tensor], step: int = 2) -> Path:
    """The checkpoint ``world_size`` ranks save of ``arrays`` (rank 0 last: it publishes)."""
    for rank in [*range(1, world_size), 0]:
        shards = {name: _Shard(whole, rank, world_size) for name, whole in arrays.items()}
        saved = save_checkpoint(root, step, shards, EXTRA, _Group(rank, world_size))
    return saved


def _write(kind: str, root: Path, world_size: int, arrays: dict[str, torch.Tensor]) -> Path:
    """A step directory as ``world_size`` ranks write it now (``kind`` "manifest"), or wrote it before
    ("legacy": one file per array in one process, rank folders under a manifest in several)."""
    if kind == "manifest":
        return _save(root, world_size, arrays)
    step_dir = root / "step-00000002"
    if world_size == 1:
        return write_single(step_dir, 2, arrays, EXTRA)
    return write_data_parallel(step_dir, 2, arrays, EXTRA, NUMELS, world_size)


@pytest.mark.parametrize("kind", ["manifest", "legacy"])
@pytest.mark.parametrize("old", [1, 2, 3, 4])
def test_every_rank_of_every_world_size_reads_its_shards_bit_for_bit(tmp_path: Path, kind: str, old: int) -> None:
    arrays = _arrays(old)
    step_dir = _write(kind, tmp_path, old, arrays)
    assert read_state(step_dir)["world_size"] == old
    verify_checkpoint(step_dir)
    for new in (1, 2, 3, 4):
        for rank in range(new):
            sinks = {name: _Collect(rank, new, whole.dtype) for name, whole in arrays.items()}
            state = load_checkpoint(step_dir, sinks, unit_numels=NUMELS)
            assert state["step"] == 2 and state["extra"]["engine"] == EXTRA["engine"]
            for name, whole in arrays.items():
                want = shards_of(whole, NUMELS, rank, new)
                assert torch.equal(sinks[name].values, want), (kind, old, new, rank, name)
                assert sinks[name].starts == sorted(sinks[name].starts)  # in the sink's own order
        gathered = {name: torch.empty_like(whole) for name, whole in arrays.items()}
        load_checkpoint(step_dir, gathered, unit_numels=NUMELS)  # a host tensor: the whole array
        assert all(torch.equal(gathered[name], whole) for name, whole in arrays.items())


def test_one_process_writes_one_shard_of_every_array(tmp_path: Path) -> None:
    arrays = _arrays(0)
    saved = save_checkpoint(tmp_path, 2, arrays, EXTRA)
    assert sorted(p.name for p in saved.iterdir()) == ["shard-00000-of-00001.bin", "state.json"]
    state = read_state(saved)
    assert state["world_size"] == 1 and state["arrays"]["exp_avg"] == {"dtype": "bfloat16", "numel": WHOLE}
    assert [part["intervals"] for part in state["shards"][0]["parts"].values()] == [[[0, WHOLE]], [[0, WHOLE]]]
    by_two = _save(tmp_path / "two", 2, arrays)
    assert sorted(p.name for p in by_two.iterdir()) == [
        "shard-00000-of-00002.bin",
        "shard-00001-of-00002.bin",
        "state.json",
    ]  # the ranks' records are folded into the manifest
    assert not list((tmp_path / "two").glob(".tmp-*"))


def test_round_trips_between_one_and_two_ranks_are_bit_identical(tmp_path: Path) -> None:
    """Saved by one process, read by two ranks and saved again by them, read by one: the same bytes."""
    arrays = _arrays(7)
    first = save_checkpoint(tmp_path / "one", 2, arrays, EXTRA)
    halves = []
    for rank in range(2):
        sinks = {name: _Collect(rank, 2, whole.dtype) for name, whole in arrays.items()}
        load_checkpoint(first, sinks)
        halves.append(sinks)
    for rank in (1, 0):
        shards = {}
        for name, sink in halves[rank].items():
            shard = _Shard(arrays[name], rank, 2)
            shard.data = sink.values  # what the rank read, not what the test knows
            shards[name] = shard
        second = save_checkpoint(tmp_path / "two", 2, shards, EXTRA, _Group(rank, 2))
    back = {name: torch.empty_like(whole) for name, whole in arrays.items()}
    load_checkpoint(second, back)
    again = save_checkpoint(tmp_path / "again", 2, back, EXTRA)
    assert (again / "shard-00000-of-00001.bin").read_bytes() == (first / "shard-00000-of-00001.bin").read_bytes()


def test_only_the_blocks_a_rank_needs_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With 64-byte blocks, rank 0 of 4 reading a 1-rank checkpoint verifies only the blocks that hold its
    shards: a damaged block elsewhere is never read by it, and fails the rank that needs it."""
    monkeypatch.setattr(manifest_module, "BLOCK_BYTES", 64)
    arrays = {"master": torch.arange(float(WHOLE))}
    step_dir = save_checkpoint(tmp_path, 2, arrays, EXTRA)
    # The last unit's last shard (rank 3 of 4) lies in the file's last block: damage that block.
    shard = step_dir / "shard-00000-of-00001.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    sink = _Collect(0, 4)
    load_checkpoint(step_dir, {"master": sink})
    assert torch.equal(sink.values, shards_of(arrays["master"], NUMELS, 0, 4))
    with pytest.raises(CheckpointCorrupt, match=r"shard-00000-of-00001.bin fails its checksum in block 7 of master"):
        load_checkpoint(step_dir, {"master": _Collect(3, 4)})


def _one_error(step_dir: Path, match: str) -> CheckpointCorrupt:
    """Loading ``step_dir`` into one process fails with one line matching ``match``, naming ``step_dir``."""
    with pytest.raises(CheckpointCorrupt, match=match) as raised:
        load_checkpoint(step_dir, {name: torch.empty_like(whole) for name, whole in _arrays(0).items()})
    assert "\n" not in str(raised.value) and raised.value.checkpoint == step_dir
    return raised.value


def test_a_corrupt_shard_is_named(tmp_path: Path) -> None:
    step_dir = _save(tmp_path, 2, _arrays(0))
    shard = step_dir / "shard-00001-of-00002.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x10  # the last byte: rank 1's part of exp_avg
    shard.write_bytes(bytes(data))
    error = _one_error(step_dir, "shard-00001-of-00002.bin fails its checksum in block 0 of exp_avg")
    assert str(error).startswith(f"checkpoint {step_dir} is corrupt (")


def test_a_missing_or_truncated_shard_is_named(tmp_path: Path) -> None:
    step_dir = _save(tmp_path, 2, _arrays(0))
    shard = step_dir / "shard-00001-of-00002.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-3])
    _one_error(step_dir, rf"shard-00001-of-00002.bin is {len(data) - 3} bytes, expected {len(data)}: truncated\?")
    shard.unlink()
    error = _one_error(step_dir, "shard-00001-of-00002.bin is missing")
    assert str(error) == f"checkpoint {step_dir} is corrupt (shard-00001-of-00002.bin is missing)"


def test_a_truncated_manifest_is_named(tmp_path: Path) -> None:
    step_dir = _save(tmp_path, 2, _arrays(0))
    text = (step_dir / "state.json").read_text()
    (step_dir / "state.json").write_text(text[: len(text) // 2])
    _one_error(step_dir, r"state\.json is not valid JSON")
    with pytest.raises(CheckpointCorrupt, match=r"state\.json is not valid JSON"):
        verify_checkpoint(step_dir)


def test_a_shard_of_another_model_is_named(tmp_path: Path) -> None:
    step_dir = _save(tmp_path, 2, _arrays(0))
    with pytest.raises(CheckpointCorrupt, match=r"its master holds 115 x float32; this run needs 116 x float32"):
        load_checkpoint(step_dir, {"master": torch.empty(WHOLE + 1)})
    legacy = write_data_parallel(tmp_path / "legacy" / "step-00000002", 2, _arrays(0), EXTRA, NUMELS, 2)
    with pytest.raises(
        CheckpointCorrupt, match=r"rank-0/master.bin of checkpoint .* holds 59 x float32; rank 0 of 2 of this model"
    ):
        load_checkpoint(legacy, {"master": torch.empty(WHOLE + 1)}, unit_numels=[*NUMELS, 1])


def test_a_checkpoint_of_one_ranks_shards_alone_is_named(tmp_path: Path) -> None:
    """A process may save its own shards without a group (a test's checkpoint per rank): it reads back at
    the same world size, and another split asks for elements it does not hold, in one line."""
    arrays = _arrays(3)
    saved = save_checkpoint(tmp_path, 2, {name: _Shard(whole, 1, 2) for name, whole in arrays.items()}, EXTRA)
    sink = _Collect(1, 2)
    load_checkpoint(saved, {"master": sink})
    assert torch.equal(sink.values, shards_of(arrays["master"], NUMELS, 1, 2))
    with pytest.raises(CheckpointCorrupt, match=r"holds no element 0 of master, which this process needs"):
        load_checkpoint(saved, {"master": _Collect(0, 1)})


def test_a_bad_legacy_manifest_is_named(tmp_path: Path) -> None:
    step_dir = write_data_parallel(tmp_path / "step-00000002", 2, _arrays(0), EXTRA, NUMELS, 2)
    state = json.loads((step_dir / "state.json").read_text())
    state["extra"]["ranks"] = ["rank-0"]
    state["checksum"] = manifest_module.checksum(state)
    (step_dir / "state.json").write_text(json.dumps(state))
    _one_error(step_dir, r"extra.ranks must name 2 rank folders")
    state["extra"]["ranks"] = ["rank-0", "rank-1"]
    state["checksum"] = manifest_module.checksum(state)
    (step_dir / "state.json").write_text(json.dumps(state))
    (step_dir / "rank-1" / "state.json").unlink()
    error = _one_error(step_dir, r"state\.json is missing")
    assert str(error) == f"checkpoint {step_dir / 'rank-1'} is corrupt (state.json is missing)"
