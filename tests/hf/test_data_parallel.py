"""slide-hf's side of data parallel (docs/distributed.md): `slide_hf.data.batches` gives each rank its rows
of every step's global batch, which together are exactly one process's batch at ``batch_size x
world_size``; ``python -m slide_hf`` is the entry a launcher such as torchrun starts; and `slide train`,
which does not run data parallel yet, refuses several processes in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from slide_hf.data import Batches, Dataset, DataStats
from slide_hf.errors import UserError


def _numbered(n: int, seq_len: int = 3) -> Dataset:
    """``n`` int32 rows whose every token is the row's index."""
    ids = torch.arange(n, dtype=torch.int32).unsqueeze(1).repeat(1, seq_len)
    positions = torch.arange(seq_len, dtype=torch.int32).repeat(n, 1)
    stats = DataStats(n, n, n * seq_len, n * seq_len, 0.0, 0, 0)
    return Dataset(ids, ids + 1000, positions, "numbered", stats)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_the_ranks_rows_together_are_one_process_batch(world_size: int, shuffle: bool) -> None:
    data = _numbered(37)
    one = Batches(data, batch_size=2 * world_size, grad_accum=2, shuffle=shuffle, seed=3)
    ranks = [
        Batches(data, batch_size=2, grad_accum=2, shuffle=shuffle, seed=3, rank=rank, world_size=world_size)
        for rank in range(world_size)
    ]
    assert all(batches.steps_per_epoch == one.steps_per_epoch for batches in ranks)
    for _ in range(2 * one.steps_per_epoch + 1):  # across epochs, each with its own order
        want = one.next_step()
        got = [batches.next_step() for batches in ranks]
        for index, micro in enumerate(want):
            parts = [step[index] for step in got]
            assert all(part.input_ids.shape == (2, 3) for part in parts)
            for field in range(3):
                assert torch.equal(torch.cat([part[field] for part in parts]), micro[field])
        assert all(batches.position == one.position for batches in ranks)  # the position is global


def test_too_few_rows_for_the_ranks() -> None:
    with pytest.raises(UserError) as info:
        Batches(_numbered(11), batch_size=2, grad_accum=2, shuffle=True, seed=0, rank=1, world_size=3)
    assert str(info.value) == "numbered yields 11 rows; one step needs 12 (--batch-size 2 x --grad-accum 2 x 3 ranks)"
    with pytest.raises(ValueError, match="rank 3 is not in a world of size 3"):
        Batches(_numbered(12), batch_size=2, grad_accum=2, shuffle=True, seed=0, rank=3, world_size=3)


def test_python_dash_m_slide_hf_is_the_cli() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "slide_hf", "train", "--no-such-flag"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.startswith("slide: error: unrecognized arguments: --no-such-flag")


def test_slide_train_refuses_several_processes(tmp_path, monkeypatch, capsys) -> None:
    from slide_hf.cli.main import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--model", "tiny-llama", "--steps", "1", "--output", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (
        "slide train: error: slide train does not run data parallel yet (WORLD_SIZE=2); launch one process "
        "(see docs/distributed.md)\n"
    )
    assert not (tmp_path / "run").exists()
